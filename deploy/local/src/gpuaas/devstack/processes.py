"""The services and the gateway as processes: spawn, one-shot commands (migrate, replay), stop, readiness.

Each runs as `python -m gpuaas.<name> serve` in its own process group (so that stopping it stops
whatever it started), logging to `<root>/logs/<name>.log` with a header line per start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx

from gpuaas.devstack.config import StackError, StackInterrupted
from gpuaas.devstack.infra import reap_group, signal_group, stop_process
from gpuaas.devstack.state import tail

log = logging.getLogger("gpuaas.devstack")
T = TypeVar("T")
COMMAND_TIMEOUT_S = 300.0


def run_coro(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from synchronous code, also when an event loop is running here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="devstack") as ex:
        return ex.submit(lambda: asyncio.run(factory())).result()


class Lifecycle:
    """Whether the stack is started, the lock its operations hold, and the cancel flag (Ctrl-C) that
    interrupts a start or a wait at its next checkpoint."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.cancel = threading.Event()
        self.started = False

    def checkpoint(self) -> None:
        if self.cancel.is_set():
            raise StackInterrupted("interrupted")

    def require_started(self) -> None:
        if not self.started:
            raise StackError("the stack is not started (call start() first)")


@dataclass
class ServiceProcess:
    name: str
    port: int
    proc: subprocess.Popen | None = None
    wanted: bool = False  # supervision restarts it when it dies
    started_mono: float = 0.0
    failures: int = 0  # consecutive unexpected deaths (reset after HEALTHY_UPTIME_S up)
    restart_due: float | None = None
    awaiting_ready: bool = False  # restarted by supervision; logged once ready again

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


class ServiceProcesses:
    """The stack's service and gateway processes, by name (services first, then the gateway)."""

    def __init__(
        self,
        names: Sequence[str],
        ports: dict[str, int],
        host: str,
        logs_dir: Path,
        python: str,
        env_of: Callable[[str], dict[str, str]],
        lifecycle: Lifecycle,
    ) -> None:
        self.host = host
        self.logs_dir = logs_dir
        self.python = python
        self.env_of = env_of  # the full environment of a process (inherited + the stack's variables)
        self.lifecycle = lifecycle
        self.by_name: dict[str, ServiceProcess] = {n: ServiceProcess(n, ports[n]) for n in names}

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    def all(self) -> list[ServiceProcess]:
        return list(self.by_name.values())

    def get(self, name: str) -> ServiceProcess:
        try:
            return self.by_name[name]
        except KeyError:
            raise KeyError(f"{name} is not part of this stack ({', '.join(self.by_name)})") from None

    def url(self, name: str) -> str:
        return f"http://{self.host}:{self.get(name).port}"

    def log_path(self, name: str) -> Path:
        return self.logs_dir / f"{name}.log"

    def _header(self, what: str) -> bytes:
        return f"\n=== {datetime.now(UTC).isoformat(timespec='seconds')} devstack: {what} ===\n".encode()

    def _popen(self, name: str, args: Sequence[str], header: str) -> subprocess.Popen:
        with open(self.log_path(name), "ab") as logf:
            logf.write(self._header(header))
            logf.flush()
            return subprocess.Popen(
                [self.python, "-m", f"gpuaas.{name}", *args],
                env=self.env_of(name),
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    # ------------------------------------------------------------------------------------ serving

    def spawn(self, name: str) -> None:
        """Start `python -m gpuaas.<name> serve`; supervision restarts it from now on when it dies."""
        sp = self.get(name)
        sp.proc = self._popen(name, ["serve"], f"serve on {self.host}:{sp.port}")
        sp.wanted = True
        sp.started_mono = time.monotonic()
        sp.restart_due = None
        log.info("started %s (pid %s) on port %s", name, sp.proc.pid, sp.port)

    def stop(self, names: Iterable[str], timeout_s: float = 20.0) -> None:
        """SIGTERM each group at once, wait together, SIGKILL what is left. They are then intentionally down."""
        procs = [self.get(n) for n in names]
        for sp in procs:
            sp.wanted = False
        live = [sp for sp in procs if sp.running]
        for sp in live:
            signal_group(sp.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for sp in live:
            assert sp.proc is not None
            try:
                sp.proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing it", sp.name, timeout_s)
                stop_process(sp.proc, signal.SIGKILL)
            reap_group(sp.proc)

    def kill(self, name: str, sig: int) -> None:
        """Signal a process group. Fatal signals wait for the exit and mark it intentionally down;
        others (SIGSTOP/SIGCONT) are just sent."""
        sp = self.get(name)
        if sig not in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            signal_group(sp.proc, sig)
            return
        sp.wanted = False
        if signal_group(sp.proc, sig) and sp.proc is not None:
            try:
                sp.proc.wait(30)
            except subprocess.TimeoutExpired:
                stop_process(sp.proc, signal.SIGKILL)

    # ----------------------------------------------------------------------------------- commands

    def run_all(self, command: str, args: Sequence[str], names: Iterable[str]) -> None:
        """`python -m gpuaas.<name> <command> <args>` for each in parallel; fail with the log tail."""
        names = list(names)
        running: dict[str, subprocess.Popen] = {}
        try:
            for name in names:
                running[name] = self._popen(name, [command, *args], " ".join([command, *args]))
            deadline = time.monotonic() + COMMAND_TIMEOUT_S
            while any(p.poll() is None for p in running.values()):
                self.lifecycle.checkpoint()
                if time.monotonic() > deadline:
                    raise StackError(f"`{command}` did not finish in {COMMAND_TIMEOUT_S:.0f}s: {list(running)}")
                time.sleep(0.1)
        finally:
            for p in running.values():
                stop_process(p, signal.SIGTERM, 5)
        failed = {n: p.returncode for n, p in running.items() if p.returncode != 0}
        if failed:
            details = "\n\n".join(
                f"--- gpuaas.{n} {command} exited with {rc}; {self.log_path(n)}:\n{tail(self.log_path(n))}"
                for n, rc in failed.items()
            )
            raise StackError(f"`{command}` failed for {', '.join(failed)}\n{details}")
        log.info("%s done: %s", command, ", ".join(names))

    # ---------------------------------------------------------------------------------- readiness

    def wait_ready(self, names: Iterable[str] | None, timeout_s: float) -> None:
        """Wait until each one answers 200 on /readyz; on timeout (or exit) name it with its log tail."""
        pending = {n for n in (self.by_name if names is None else names) if n in self.by_name}
        last: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=3.0) as client:
            while pending:
                self.lifecycle.checkpoint()
                for name in sorted(pending):
                    sp = self.by_name[name]
                    if not sp.running:
                        rc = sp.proc.returncode if sp.proc is not None else None
                        raise StackError(
                            f"{name} is not running (exit code {rc}) — {self.log_path(name)}:\n"
                            f"{tail(self.log_path(name))}"
                        )
                    try:
                        r = client.get(f"{self.url(name)}/readyz")
                        if r.status_code == 200:
                            pending.discard(name)
                            continue
                        last[name] = f"HTTP {r.status_code} {r.text[:300]}"
                    except httpx.HTTPError as exc:
                        last[name] = f"{type(exc).__name__}: {exc}"
                if not pending:
                    break
                if time.monotonic() > deadline:
                    details = "\n\n".join(
                        f"--- {n}: last /readyz: {last.get(n, '-')}\n{self.log_path(n)}:\n{tail(self.log_path(n))}"
                        for n in sorted(pending)
                    )
                    raise StackError(f"not ready after {timeout_s:.0f}s: {', '.join(sorted(pending))}\n{details}")
                time.sleep(0.25)

    def log_ready_again(self) -> None:
        """Log, once, each process that supervision restarted and that answers /readyz again."""
        for sp in self.by_name.values():
            if not (sp.awaiting_ready and sp.running):
                continue
            try:
                if httpx.get(f"{self.url(sp.name)}/readyz", timeout=1.0).status_code == 200:
                    sp.awaiting_ready = False
                    log.info("%s is ready again (pid %s)", sp.name, sp.pid)
            except httpx.HTTPError:
                pass

    def live_pid(self, name: str) -> int | None:
        sp = self.by_name.get(name)
        return sp.pid if sp is not None and sp.running else None
