"""GPU inventory parsing on captured nvidia-smi output, declarations, and discovery fallback."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpuaas.node_agent.gpus import discover, normalise_model, parse_csv, parse_declared, parse_xml

SAMPLES = Path(__file__).parent / "samples"


def test_csv_query_output() -> None:
    gpus = parse_csv((SAMPLES / "nvidia-smi-query.csv").read_text())
    assert [(g.index, g.model, g.memory_mb) for g in gpus] == [
        (0, "H100-80GB", 81559),
        (1, "H100-80GB", 81559),
        (2, "A100-80GB", 81920),
        (3, "V100-16GB", 16384),
    ]
    assert gpus[0].device_uuid == "GPU-6f1a2c3e-0b1d-4a52-9a1e-1f2e3d4c5b6a"


def test_xml_output() -> None:
    gpus = parse_xml((SAMPLES / "nvidia-smi-q.xml").read_text())
    assert [(g.index, g.model, g.memory_mb) for g in gpus] == [(0, "H100-80GB", 81559), (1, "A100-40GB", 40960)]


@pytest.mark.parametrize(
    ("name", "mem", "model"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA H100 PCIe", 81559, "H100-80GB"),
        ("NVIDIA L4", 23034, "L4-22GB"),
        ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
    ],
)
def test_model_names_are_normalised(name: str, mem: int, model: str) -> None:
    assert normalise_model(name, mem) == model


def test_declared() -> None:
    gpus = parse_declared("2xH100-80GB, 1xL4-24GB:23034")
    assert [(g.index, g.model, g.memory_mb) for g in gpus] == [
        (0, "H100-80GB", 81920),
        (1, "H100-80GB", 81920),
        (2, "L4-24GB", 23034),
    ]
    with pytest.raises(ValueError):
        parse_declared("eight H100s")


def test_discover_prefers_nvidia_smi_and_falls_back(tmp_path: Path) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\ncat {SAMPLES / 'nvidia-smi-query.csv'}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    gpus, source = discover(str(fake), "8xH100-80GB")
    assert source == "nvidia-smi" and len(gpus) == 4
    gpus, source = discover(str(tmp_path / "absent"), "8xH100-80GB")
    assert source == "declared" and len(gpus) == 8
    broken = tmp_path / "broken-smi"
    broken.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    broken.chmod(0o755)
    assert discover(str(broken), "1xA100-80GB")[1] == "declared"
    assert os.access(broken, os.X_OK)
