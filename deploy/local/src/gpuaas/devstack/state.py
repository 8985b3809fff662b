"""What a stack leaves on disk, and how a later command finds its processes again.

`<root>/stack.json` records URLs, pids (with their start times: pids get reused) and the seeded logins;
`<root>/secrets.json` the passwords. `python -m gpuaas.devstack stop|status` and a new run that finds a
dead runner's leftovers read stack.json back with these helpers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil

from gpuaas.devstack.config import StackError

log = logging.getLogger("gpuaas.devstack")
STATE_VERSION = 1


def write_private(path: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically, readable by the owner only (it holds passwords)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def tail(path: Path, lines: int = 40) -> str:
    """The last lines of a log file (empty when there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(f.tell() - 32_768, 0))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def proc_matches(pid: int | None, create_time: float | None) -> psutil.Process | None:
    """The process with this pid if it is still the one recorded (pids get reused)."""
    if not pid:
        return None
    try:
        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - create_time) > 1.0:
            return None
        return p if p.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def process_record(pid: int | None) -> dict[str, Any]:
    """How stack.json records a process: its pid and start time (see proc_matches)."""
    try:
        create_time = psutil.Process(pid).create_time() if pid else None
    except psutil.Error:
        create_time = None
    return {"pid": pid, "create_time": create_time}


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until the processes have exited; return those still alive. A zombie counts as gone: a
    process that is not our child is reaped by its own parent, maybe not soon (psutil's wait() would
    wait for that)."""

    def gone(p: psutil.Process) -> bool:
        try:
            return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if not gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if not gone(p)]
    return alive


def stop_recorded(state: dict[str, Any], timeout_s: float = 20.0) -> list[str]:
    """Stop the processes a stack.json records (checking that each pid is still the recorded process).

    Used by `python -m gpuaas.devstack stop` and by a new run that finds a dead runner's leftovers.
    Returns the names of the processes that were still running.
    """
    found: dict[str, psutil.Process] = {}
    for name, info in (state.get("processes") or {}).items():
        p = proc_matches(info.get("pid"), info.get("create_time"))
        if p is not None and p.pid != os.getpid():
            found[name] = p
    for name, p in found.items():
        # Postgres: SIGINT is its fast shutdown; everything else takes SIGTERM.
        sig = signal.SIGINT if name == "postgres" else signal.SIGTERM
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)
    alive = wait_gone(list(found.values()), timeout_s)
    for p in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    wait_gone(alive, 5)
    # Whatever else was in those groups (they are process-group leaders).
    for p in found.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    return list(found)


def take_over_previous(state_path: Path) -> dict[str, Any]:
    """Read the previous run's state; refuse a live runner, clean up after a dead one."""
    previous = read_json(state_path)
    if not previous.get("running"):
        return previous
    runner = previous.get("runner") or {}
    if runner.get("pid") != os.getpid() and proc_matches(runner.get("pid"), runner.get("create_time")):
        raise StackError(
            f"a stack is already running from {state_path.parent} (runner pid {runner['pid']}); "
            "stop it first: python -m gpuaas.devstack stop"
        )
    leftovers = stop_recorded(previous)
    if leftovers:
        log.warning("stopped processes left by a previous run that did not stop cleanly: %s", leftovers)
    return previous
