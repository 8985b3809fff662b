"""GPU inventory: `nvidia-smi` where present, else the GPUs declared in the agent's config.

Model names are normalised to the platform's form, e.g. "NVIDIA H100 80GB HBM3" -> "H100-80GB",
"NVIDIA A100-SXM4-80GB" -> "A100-80GB", "Tesla V100-SXM2-16GB" -> "V100-16GB".
"""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

from gpuaas.contracts.events.allocations import GpuDevice

QUERY = ["--query-gpu=index,name,memory.total,uuid", "--format=csv,noheader,nounits"]
_FAMILY = re.compile(r"\b([A-Z]{1,3}\d{1,4}[A-Z]?)\b")


def normalise_model(name: str, memory_mb: int) -> str:
    text = name.upper().replace("NVIDIA", "").replace("TESLA", "").replace("GEFORCE", "")
    family = None
    for m in _FAMILY.finditer(text.replace("-", " ")):
        if any(c.isdigit() for c in m.group(1)):
            family = m.group(1)
            break
    family = family or text.strip().split()[0]
    gb = re.search(r"(\d+)\s*GB", text)
    size = int(gb.group(1)) if gb else round(memory_mb / 1024)
    return f"{family}-{size}GB"


def parse_csv(output: str) -> list[GpuDevice]:
    """`nvidia-smi --query-gpu=index,name,memory.total,uuid --format=csv,noheader,nounits`."""
    gpus: list[GpuDevice] = []
    for row in csv.reader(io.StringIO(output)):
        if len(row) < 4 or not row[0].strip().isdigit():
            continue
        index, name, mem, uuid_ = (c.strip() for c in row[:4])
        memory = int(float(mem)) if mem.replace(".", "", 1).isdigit() else 0
        gpus.append(
            GpuDevice(
                index=int(index), model=normalise_model(name, memory), memory_mb=memory, device_uuid=uuid_ or None
            )
        )
    return sorted(gpus, key=lambda g: g.index)


def parse_xml(output: str) -> list[GpuDevice]:
    """`nvidia-smi -q -x`."""
    root = ET.fromstring(output)
    gpus: list[GpuDevice] = []
    for i, gpu in enumerate(root.findall("gpu")):
        name = (gpu.findtext("product_name") or "").strip()
        total = (gpu.findtext("fb_memory_usage/total") or "0").split()[0]
        index = gpu.findtext("minor_number")
        memory = int(float(total)) if total.replace(".", "", 1).isdigit() else 0
        gpus.append(
            GpuDevice(
                index=int(index) if index and index.strip().isdigit() else i,
                model=normalise_model(name, memory),
                memory_mb=memory,
                device_uuid=(gpu.findtext("uuid") or None),
            )
        )
    return sorted(gpus, key=lambda g: g.index)


def parse_declared(spec: str) -> list[GpuDevice]:
    """ "8xH100-80GB" or "4xA100-80GB:81920,2xL4-24GB" -> devices indexed in order."""
    gpus: list[GpuDevice] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"(\d+)\s*[xX]\s*([A-Za-z0-9._-]+)(?::(\d+))?", part)
        if not m:
            raise ValueError(f"bad GPU declaration {part!r}; expected e.g. 8xH100-80GB or 4xA100-80GB:81920")
        count, model, mem = int(m.group(1)), m.group(2), m.group(3)
        gb = re.search(r"(\d+)GB$", model, re.I)
        memory = int(mem) if mem else (int(gb.group(1)) * 1024 if gb else 0)
        for _ in range(count):
            gpus.append(GpuDevice(index=len(gpus), model=model, memory_mb=memory))
    return gpus


def discover(
    nvidia_smi: str = "nvidia-smi", declared: str = "", prefer_nvidia_smi: bool = True
) -> tuple[list[GpuDevice], str]:
    """(GPUs, source): nvidia-smi when it exists and answers, otherwise the declaration."""
    exe = shutil.which(nvidia_smi) if prefer_nvidia_smi else None
    if exe:
        try:
            out = subprocess.run([exe, *QUERY], capture_output=True, text=True, timeout=20, check=True).stdout
            gpus = parse_csv(out)
            if gpus:
                return gpus, "nvidia-smi"
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    return parse_declared(declared), "declared"
