"""GPU devices for containers through CDI (Container Device Interface).

Real GPUs: the NVIDIA container toolkit generates a spec of kind `nvidia.com/gpu`
(`nvidia-ctk cdi generate`, in /etc/cdi or /var/run/cdi); a container gets `--device
nvidia.com/gpu=<index>`.

Declared GPUs (no driver, tests, demos): the agent writes its own spec, kind
`gpuaas.local/gpu-<agent id>` (one kind per agent, so several agents on one machine never clash),
one device per declared index with the node `/dev/nvidia<index>`. The host node is a fake: a
character device with /dev/null's numbers (1:3), created only where no node of that name exists.
Why on the host at the same path: with `--userns=auto` runc cannot mknod inside the user namespace
and bind-mounts each device node from the host *at its container path* (a spec whose hostPath
differs from its path fails with "error creating device nodes ... no such file"), as it is for real
GPUs. Only the assigned nodes appear inside the container.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

NVIDIA_KIND = "nvidia.com/gpu"
SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
FAKE_MAJOR, FAKE_MINOR = 1, 3


def nvidia_spec_present() -> bool:
    for d in SPEC_DIRS:
        if not d.is_dir():
            continue
        for f in d.glob("*"):
            try:
                text = f.read_text()
            except OSError:
                continue
            if f.suffix in (".json", ".yaml", ".yml") and NVIDIA_KIND in text:
                return True
    return False


def fake_kind(agent_id: str) -> str:
    return f"gpuaas.local/gpu-{agent_id}"


def write_fake_spec(cdi_dir: Path, agent_id: str, indices: list[int]) -> str:
    """Write (replace) this agent's spec for its declared GPUs; returns the kind."""
    for i in indices:
        node = Path(f"/dev/nvidia{i}")
        try:
            st = node.stat()
            if not stat.S_ISCHR(st.st_mode):
                raise RuntimeError(f"{node} exists and is not a character device")
        except FileNotFoundError:
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(FAKE_MAJOR, FAKE_MINOR))
    kind = fake_kind(agent_id)
    spec = {
        "cdiVersion": "0.5.0",
        "kind": kind,
        "devices": [
            {"name": str(i), "containerEdits": {"deviceNodes": [{"path": f"/dev/nvidia{i}"}]}} for i in indices
        ],
    }
    cdi_dir.mkdir(parents=True, exist_ok=True)
    path = cdi_dir / f"gpuaas-{agent_id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(spec))
    os.replace(tmp, path)
    return kind
