"""Per-allocation workspaces on the host (the unprivileged form of a Unix account).

    <state>/allocations/<allocation_id>/meta.json        username, GPUs, status
    <state>/allocations/<allocation_id>/authorized_keys  the owner's and the grantees' keys
    <state>/allocations/<allocation_id>/home/            $HOME of every session (scratch lives here)
    <state>/volumes/<volume_id>/                         a volume's data; mounted as a symlink in home

Every process started for an allocation carries `GPUAAS_ALLOCATION_ID` in its environment, so
`kill_all` finds them even when they daemonise out of their session, and release can verify that
none is left. Every operation is idempotent: a task delivered twice leaves the same state.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_MARK = "GPUAAS_ALLOCATION_ID"


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
    def active(self) -> bool:
        return self.meta.get("status") == "active"

    def authorized_keys(self) -> str:
        try:
            return self.keys_path.read_text()
        except OSError:
            return ""

    def env(self) -> dict[str, str]:
        meta = self.meta
        return {
            "HOME": str(self.home),
            "USER": self.username,
            "LOGNAME": self.username,
            "SHELL": "/bin/bash",
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in meta.get("gpu_indices", [])),
            ENV_MARK: self.allocation_id,
        }


class Workspaces:
    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir / "allocations"
        self.volumes_root = state_dir / "volumes"
        self.root.mkdir(parents=True, exist_ok=True)
        self.volumes_root.mkdir(parents=True, exist_ok=True)

    def get(self, allocation_id: str) -> Workspace:
        return Workspace(allocation_id, self.root / allocation_id)

    def by_username(self, username: str) -> Workspace | None:
        for d in self.root.iterdir() if self.root.exists() else []:
            ws = Workspace(d.name, d)
            if ws.username == username:
                return ws
        return None

    # --------------------------------------------------------------------------------------- steps

    def provision(self, p: dict[str, Any]) -> Workspace:
        ws = self.get(p["allocation_id"])
        ws.home.mkdir(parents=True, exist_ok=True)
        os.chmod(ws.root, 0o700)
        ws.write_meta(username=p["username"], gpu_indices=p.get("gpu_indices", []), status="provisioning")
        self.write_keys(ws, p.get("authorized_keys", []))
        for v in p.get("volumes", []):
            self.mount(ws, v["volume_id"], v["mount_path"])
        (ws.home / ".gpuaas").write_text(
            f"allocation {ws.allocation_id}\nCUDA_VISIBLE_DEVICES={ws.env()['CUDA_VISIBLE_DEVICES']}\n"
        )
        return ws

    def activate(self, ws: Workspace) -> None:
        ws.write_meta(status="active")

    def write_keys(self, ws: Workspace, keys: list[str]) -> None:
        tmp = ws.root / ".authorized_keys.tmp"
        tmp.write_text("".join(k.strip() + "\n" for k in keys))
        os.chmod(tmp, 0o600)
        os.replace(tmp, ws.keys_path)

    def mount(self, ws: Workspace, volume_id: str, mount_path: str) -> Path:
        data = self.volumes_root / volume_id
        data.mkdir(parents=True, exist_ok=True)
        link = ws.home / mount_path.lstrip("/")
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() and os.readlink(link) != str(data):
            link.unlink()
        if not link.is_symlink():
            link.symlink_to(data, target_is_directory=True)
        return link

    def unmount(self, ws: Workspace, volume_id: str, mount_path: str, *, delete_data: bool) -> None:
        link = ws.home / mount_path.lstrip("/")
        if link.is_symlink():
            link.unlink()
        if delete_data:
            shutil.rmtree(self.volumes_root / volume_id, ignore_errors=True)

    def set_gpus(self, ws: Workspace, indices: list[int]) -> None:
        ws.write_meta(gpu_indices=indices)

    def remove(self, ws: Workspace) -> None:
        ws.write_meta(status="releasing")
        for link in ws.home.rglob("*") if ws.home.exists() else []:
            if link.is_symlink():
                link.unlink()  # never follow a volume mount into its data
        shutil.rmtree(ws.root, ignore_errors=False)


def processes_of(allocation_id: str) -> list[int]:
    """Pids whose environment marks them as the allocation's (readable for our own processes)."""
    mark = f"{ENV_MARK}={allocation_id}".encode()
    pids = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def kill_all(allocation_id: str, timeout_s: float = 5.0) -> list[int]:
    """SIGKILL every process of the allocation, then verify none is left; returns survivors."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [p for p in processes_of(allocation_id) if not _zombie(p)]
        if not pids:
            return []
        if time.monotonic() > deadline:
            return pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True
