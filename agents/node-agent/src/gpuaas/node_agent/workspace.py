"""Per-allocation state on the host, shared by both runtime drivers.

    <state>/allocations/<allocation_id>/meta.json        username, GPUs, volumes, runtime, limits, status
    <state>/allocations/<allocation_id>/authorized_keys  the owner's and the grantees' keys (the agent's
                                                         SSH endpoint reads them; never inside the allocation)
    <state>/allocations/<allocation_id>/home/            $HOME of every session (the container driver
                                                         bind-mounts it at /home/<username>)
    <state>/volumes/<volume_id>/                         a volume's data

`<state>/allocations/<id>` is 0700 and owned by the agent: only `home/` and the volume directories
are the allocation's, and every write there goes through `safefs` (no symlink is followed). Every
operation is idempotent: a task delivered twice leaves the same state.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuaas.contracts.agent import ProvisionTask
from gpuaas.node_agent import safefs


@dataclass
class Workspace:
    allocation_id: str
    root: Path

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def keys_path(self) -> Path:
        return self.root / "authorized_keys"

    @property
    def meta(self) -> dict[str, Any]:
        try:
            return json.loads((self.root / "meta.json").read_text())
        except (OSError, ValueError):
            return {}

    def write_meta(self, **values: Any) -> None:
        meta = {**self.meta, **values}
        tmp = self.root / ".meta.json.tmp"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, self.root / "meta.json")

    @property
    def username(self) -> str:
        return str(self.meta.get("username", ""))

    @property
    def status(self) -> str:
        return str(self.meta.get("status", ""))

    @property
    def active(self) -> bool:
        return self.status == "active"

    @property
    def gpu_indices(self) -> list[int]:
        return [int(i) for i in self.meta.get("gpu_indices", [])]

    @property
    def volumes(self) -> list[dict[str, str]]:
        return list(self.meta.get("volumes", []))

    def authorized_keys(self) -> str:
        try:
            return self.keys_path.read_text()
        except OSError:
            return ""

    def cuda_visible_devices(self) -> str:
        return ",".join(str(i) for i in self.gpu_indices)


ENV_MARK = "GPUAAS_ALLOCATION_ID"  # set in process-driver sessions; informative only (the user can drop it)


def processes_of(allocation_id: str) -> list[int]:
    """Pids whose environment carries the allocation's mark (process driver; never used as proof of release)."""
    mark = f"{ENV_MARK}={allocation_id}".encode()
    pids: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


class Workspaces:
    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir / "allocations"
        self.volumes_root = state_dir / "volumes"
        self.root.mkdir(parents=True, exist_ok=True)
        self.volumes_root.mkdir(parents=True, exist_ok=True)
        os.chmod(state_dir, 0o700)  # the token, host key and journal live here

    def get(self, allocation_id: str) -> Workspace:
        return Workspace(allocation_id, self.root / allocation_id)

    def all(self) -> list[Workspace]:
        return [Workspace(d.name, d) for d in sorted(self.root.iterdir()) if d.is_dir() and not d.is_symlink()]

    def by_username(self, username: str) -> Workspace | None:
        for ws in self.all():
            if ws.username == username:
                return ws
        return None

    def volume_dir(self, volume_id: str) -> Path:
        safefs.path_parts(volume_id)  # an id, never a path
        path = self.volumes_root / volume_id
        if not path.is_symlink():
            path.mkdir(exist_ok=True)
        return path

    # --------------------------------------------------------------------------------------- steps

    def provision(self, p: ProvisionTask) -> Workspace:
        ws = self.get(str(p.allocation_id))
        ws.root.mkdir(mode=0o700, exist_ok=True)
        os.chmod(ws.root, 0o700)
        if not ws.home.is_symlink():
            ws.home.mkdir(exist_ok=True)
        ws.write_meta(
            username=p.username,
            gpu_indices=p.gpu_indices,
            volumes=[{"volume_id": str(v.volume_id), "mount_path": v.mount_path} for v in p.volumes],
            runtime=p.runtime.model_dump(mode="json") if p.runtime else None,
            limits=p.limits.model_dump(mode="json") if p.limits else None,
            # a launchable app's workload and its secret (issue 21)
            workload=p.workload.model_dump(mode="json") if p.workload else None,
            workload_token=p.workload_token,
            project_id=str(p.project_id) if p.project_id else None,  # the container driver's project network
            overlay=p.overlay.model_dump(mode="json") if p.overlay else None,  # its segment across hosts
            status=ws.status if ws.status == "active" else "provisioning",
        )
        self.write_keys(ws, p.authorized_keys)
        for v in p.volumes:
            self.volume_dir(str(v.volume_id))
        return ws

    def write_marker(self, ws: Workspace) -> None:
        """~/.gpuaas: what the allocation is (written without following a link the user may have put there)."""
        text = f"allocation {ws.allocation_id}\nCUDA_VISIBLE_DEVICES={ws.cuda_visible_devices()}\n"
        safefs.write_file(ws.home, ".gpuaas", text.encode())

    def activate(self, ws: Workspace) -> None:
        ws.write_meta(status="active")

    def write_keys(self, ws: Workspace, keys: list[str]) -> None:
        tmp = ws.root / ".authorized_keys.tmp"
        tmp.write_text("".join(k.strip() + "\n" for k in keys))
        os.chmod(tmp, 0o600)
        os.replace(tmp, ws.keys_path)

    def add_volume(self, ws: Workspace, volume_id: str, mount_path: str) -> None:
        self.volume_dir(volume_id)
        volumes = [v for v in ws.volumes if v["volume_id"] != volume_id]
        ws.write_meta(volumes=[*volumes, {"volume_id": volume_id, "mount_path": mount_path}])

    def drop_volume(self, ws: Workspace, volume_id: str, *, delete_data: bool) -> None:
        if ws.root.exists():
            ws.write_meta(volumes=[v for v in ws.volumes if v["volume_id"] != volume_id])
        if delete_data:
            safefs.rmtree(self.volumes_root / volume_id)

    def set_gpus(self, ws: Workspace, indices: list[int]) -> None:
        ws.write_meta(gpu_indices=indices)

    def remove(self, ws: Workspace) -> None:
        """Remove the allocation's state; links in its home are unlinked, never followed."""
        safefs.rmtree(ws.root)
