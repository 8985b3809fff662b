"""The process driver: sessions run on the host as the agent's user, in the allocation's workspace.

It does NOT isolate tenants (every session can see and signal every other process of the same
user), so a host on this driver reports `isolates_tenants: false` and placement keeps one tenant on
it. What it does guarantee: everything a session starts is found at release, because each session
joins the allocation's own cgroup (pids controller: /sys/fs/cgroup/pids/gpuaas-<agent>/<allocation>
on cgroup v1, /sys/fs/cgroup/gpuaas-<agent>/<allocation> on v2) before it execs, and children
cannot leave a cgroup without privileges over it. A scrubbed environment, a double fork or setsid
changes nothing. Without a writable cgroup tree (an unprivileged agent) it falls back to the
`GPUAAS_ALLOCATION_ID` environment mark, which a session can remove: release then says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from gpuaas.node_agent import safefs
from gpuaas.node_agent.drivers.base import SESSION_MARK, Driver, DriverError, SessionCommand
from gpuaas.node_agent.workspace import ENV_MARK, Workspace, processes_of

SHELL = shutil.which("bash") or "/bin/sh"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_parent(agent_id: str) -> Path | None:
    """This agent's cgroup directory (created), or None when the host gives us none we can write."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        parent = CGROUP_ROOT / f"gpuaas-{agent_id}"  # cgroup v2 (unified)
    elif (CGROUP_ROOT / "pids" / "cgroup.procs").exists():
        parent = CGROUP_ROOT / "pids" / f"gpuaas-{agent_id}"
    else:
        return None
    try:
        parent.mkdir(exist_ok=True)
        return parent if os.access(parent / "cgroup.procs", os.W_OK) else None
    except OSError:
        return None


def cgroup_pids(cgroup: Path) -> list[int]:
    try:
        return [int(x) for x in (cgroup / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def kill_cgroup(cgroup: Path, timeout_s: float = 5.0) -> list[int]:
    """SIGKILL every process in the cgroup until it is empty; the survivors when the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while pids := [p for p in cgroup_pids(cgroup) if not _zombie(p)]:
        if time.monotonic() > deadline:
            return pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    return []


def processes_marked(allocation_id: str) -> list[int]:
    """Fallback only: pids whose environment carries the allocation's mark (the user can remove it)."""
    return [p for p in processes_of(allocation_id) if not _zombie(p)]


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class ProcessDriver(Driver):
    name = "process"
    isolates_tenants = False

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.cgroups = cgroup_parent(self.agent_id)

    def cgroup(self, ws: Workspace) -> Path | None:
        if self.cgroups is None:
            return None
        path = self.cgroups / ws.allocation_id
        path.mkdir(exist_ok=True)
        return path

    def _link_volumes(self, ws: Workspace) -> None:
        for v in ws.volumes:
            safefs.make_link(ws.home, v["mount_path"], self.workspaces.volume_dir(v["volume_id"]))

    async def _kill(self, ws: Workspace) -> list[int]:
        cg = self.cgroup(ws)
        if cg is not None:
            return await asyncio.to_thread(kill_cgroup, cg)
        survivors = []
        for _ in range(50):
            survivors = processes_marked(ws.allocation_id)
            for pid in survivors:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if not survivors:
                break
            await asyncio.sleep(0.05)
        return survivors

    async def stop(self, ws: Workspace, timeout_s: float) -> None:
        """SIGTERM every process of the allocation, then wait up to `timeout_s` for them to exit (the release
        SIGKILLs what is left)."""
        deadline = time.monotonic() + timeout_s
        while True:
            cg = self.cgroup(ws)
            pids = (
                [p for p in cgroup_pids(cg) if not _zombie(p)] if cg is not None else processes_marked(ws.allocation_id)
            )
            if not pids or time.monotonic() >= deadline:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            await asyncio.sleep(0.2)

    async def write_notice(self, ws: Workspace, name: str, body: str) -> str:
        # No /run of its own: the workspace's home, written without following a link the user may have put there.
        relative = f".gpuaas-{name}"
        await asyncio.to_thread(safefs.write_file, ws.home, relative, body.encode())
        return f"~/{relative}"

    async def reconcile(self) -> dict[str, Any]:
        removed: list[dict[str, str]] = []
        if self.cgroups is not None:
            for cg in [d for d in self.cgroups.iterdir() if d.is_dir()]:
                ws = self.workspaces.get(cg.name)
                if ws.status != "active" and not ws.root.exists():
                    await asyncio.to_thread(kill_cgroup, cg)
                    with contextlib.suppress(OSError):
                        cg.rmdir()
                    removed.append({"allocation_id": cg.name, "what": "cgroup", "reason": "unknown allocation"})
        return {"driver": self.name, "removed": removed, "recreated": [], "failed": []}

    async def provision(self, ws: Workspace) -> str:
        self.cgroup(ws)
        self._link_volumes(ws)
        return "workspace on the host (process driver: no tenant isolation)"

    async def restart(self, ws: Workspace) -> str:
        survivors = await self._kill(ws)
        if survivors:
            raise DriverError(f"processes {survivors} of the allocation survived SIGKILL")
        self._link_volumes(ws)
        return "every process stopped; workspace, keys and volumes re-applied"

    async def apply(self, ws: Workspace, dropped_mounts: list[str]) -> str:
        for mount_path in dropped_mounts:
            safefs.remove_link(ws.home, mount_path)
        self._link_volumes(ws)
        return f"CUDA_VISIBLE_DEVICES={ws.cuda_visible_devices()} for new sessions"

    async def release(self, ws: Workspace) -> dict[str, Any]:
        checked: list[str] = []
        survivors = await self._kill(ws)
        cg = self.cgroup(ws)
        if cg is not None:
            left = cgroup_pids(cg)
            checked.append(f"cgroup {cg}: {len(left)} process(es) left")
            with contextlib.suppress(OSError):
                cg.rmdir()
        else:
            left = survivors
            checked.append(f"no cgroup available: processes found by the {ENV_MARK} mark only (user-controlled)")
        await asyncio.to_thread(self.workspaces.remove, ws)
        checked.append(f"state dir {ws.root}: {'present' if ws.root.exists() else 'absent'}")
        evidence = {
            "driver": self.name,
            "container_removed": None,  # not applicable
            "cgroup_empty": not left if cg is not None else None,
            "pid_namespace_gone": None,  # not applicable: sessions share the host's
            "mounts_gone": not ws.root.exists(),  # volumes are links inside the removed workspace
            "state_dir_gone": not ws.root.exists(),
            "processes_left": left,
            "checked": checked,
        }
        if left or ws.root.exists():
            raise DriverError(f"release verification failed: {'; '.join(checked)}")
        return evidence

    def session(self, ws: Workspace, command: str | None, term: str | None, mark: str = "") -> SessionCommand:
        argv = [SHELL, "-c", command] if command else [SHELL, "-i"] if SHELL.endswith("bash") else [SHELL]
        env = {
            "HOME": str(ws.home),
            "USER": ws.username,
            "LOGNAME": ws.username,
            "SHELL": "/bin/bash",
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "CUDA_VISIBLE_DEVICES": ws.cuda_visible_devices(),
            ENV_MARK: ws.allocation_id,
        }
        if term:
            env["TERM"] = term
        if mark:
            env[SESSION_MARK] = mark
        cg = self.cgroup(ws)
        return SessionCommand(argv, env, str(ws.home), cgroup_procs=cg / "cgroup.procs" if cg else None)
