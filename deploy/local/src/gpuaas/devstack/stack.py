"""The local stack as a library: the runner behind `make run` and the e2e test fixtures both use it.

A `Stack` owns Postgres (embedded unless `GPUAAS_DATABASE_URL` names an existing server), the broker
(embedded Tansu unless `GPUAAS_KAFKA_BOOTSTRAP` names an existing one), and every service and the
gateway as real processes, each in its own process group, logging to `<root>/logs/<name>.log`.

    stack = Stack(root=tmp_path, free_ports=True)
    stack.start()                          # provision, migrate, start, wait for every /readyz
    stack.kill("billing"); stack.start_service("billing")
    stack.restart_broker()                 # fresh Tansu, services restarted, outbox replayed
    await stack.fetchval("billing", "SELECT count(*) FROM outbox")
    stack.stop()                           # nothing is left running

The methods are synchronous (they wait for processes); from async tests call the slow ones with
`await asyncio.to_thread(stack.restart_broker)` if other tasks must keep running meanwhile.

Tansu keeps everything in memory: when the embedded broker is restarted (or dies and the supervisor
restarts it) every service is restarted, so that its producer and consumer talk to the new broker,
and `python -m gpuaas.<service> replay --since <the lost broker's start time>` requeues what had
been published to the lost broker (consumers dedupe by event id).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import hmac
import importlib.util
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import httpx
import psutil

from gpuaas.devstack.agents import DEFAULT_AGENTS, LocalAgents
from gpuaas.devstack.infra import (
    EmbeddedPostgres,
    Tansu,
    free_port,
    port_in_use,
    reap_group,
    signal_group,
    stop_process,
)
from gpuaas.devstack.kafka import ApacheKafka

log = logging.getLogger("gpuaas.devstack")
T = TypeVar("T")

SERVICES: tuple[str, ...] = ("identity", "allocations", "catalog", "app_runtime", "metering", "billing")
GATEWAY = "gateway"
DEFAULT_PORTS: dict[str, int] = {
    "gateway": 8000,
    "identity": 8001,
    "allocations": 8002,
    "catalog": 8003,
    "app_runtime": 8004,
    "metering": 8005,
    "billing": 8006,
    "postgres": 5433,
    "kafka": 9092,
}
DEFAULT_ROOT = Path(".local")
DEFAULT_ADMIN_EMAIL = "admin@gpuaas.local"
STATE_VERSION = 1
# Replay a little before the lost broker's start: the database clock (outbox created_at) and ours
# may differ when the database is external. Replaying too much is harmless (consumers dedupe).
REPLAY_MARGIN_S = 30.0
# A service that stayed up this long is healthy again: its restart backoff starts over.
HEALTHY_UPTIME_S = 60.0
MAX_BACKOFF_S = 30.0


class StackError(RuntimeError):
    """The stack could not do what was asked; the message says which process and why."""


class StackInterrupted(StackError):
    """`Stack.cancel` was set (Ctrl-C in the runner) while the stack was starting or waiting."""


def module_available(name: str) -> bool:
    """Whether `python -m gpuaas.<name>` can run (the package has a `__main__`)."""
    try:
        return importlib.util.find_spec(f"gpuaas.{name}.__main__") is not None
    except ModuleNotFoundError:
        return False


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


def _run_coro(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from synchronous code, also when an event loop is running here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="devstack") as ex:
        return ex.submit(lambda: asyncio.run(factory())).result()


def _plain_url(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return "postgresql://" + rest if scheme.startswith("postgres") else url


def _with_database(url: str, database: str) -> str:
    p = urlsplit(_plain_url(url))
    return urlunsplit((p.scheme, p.netloc, f"/{database}", p.query, ""))


def _redact(url: str) -> str:
    p = urlsplit(url)
    if p.password is None:
        return url
    return urlunsplit(p._replace(netloc=p.netloc.replace(f":{p.password}@", ":***@")))


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


def _create_time(pid: int | None) -> float | None:
    try:
        return psutil.Process(pid).create_time() if pid else None
    except psutil.Error:
        return None


@dataclass
class StackConfig:
    root: Path = DEFAULT_ROOT
    # Port overrides by process name (see DEFAULT_PORTS); anything not given is the default, or a
    # free loopback port with free_ports=True.
    ports: dict[str, int] = field(default_factory=dict)
    free_ports: bool = False
    services: Sequence[str] = SERVICES
    gateway: bool = True
    # Extra environment per process name; "*" applies to every service and the gateway.
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    # An existing server's superuser URL / an existing broker: the stack then starts neither.
    database_url: str | None = None
    kafka_bootstrap: str | None = None
    database: str = "gpuaas"
    admin_email: str = DEFAULT_ADMIN_EMAIL
    host: str = "127.0.0.1"
    ready_timeout_s: float = 180.0
    # Tests only: run without services whose package has no `__main__` yet. The real run needs all.
    skip_missing: bool = False
    # After a restart of the stack on existing data, replay what the previous (lost) broker had.
    replay_on_start: bool = True
    python: str = sys.executable
    # The broker the stack runs when no kafka_bootstrap is given: "tansu" (embedded, memory only) or
    # "kafka" (Apache Kafka 4.x KRaft under <root>/kafka, whose log survives restart_broker()).
    broker: str = "tansu"
    # Local node-agents (name, declared GPUs) enrolled and started once the services are ready.
    agents: Sequence[tuple[str, str]] = DEFAULT_AGENTS

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> StackConfig:
        """Defaults, then `GPUAAS_DATABASE_URL` / `GPUAAS_KAFKA_BOOTSTRAP`, then explicit overrides."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {
            "database_url": env.get("GPUAAS_DATABASE_URL") or None,
            "kafka_bootstrap": env.get("GPUAAS_KAFKA_BOOTSTRAP") or None,
            "broker": env.get("GPUAAS_STACK_BROKER") or "tansu",
        }
        values.update({k: v for k, v in overrides.items()})
        if "root" in values:
            values["root"] = Path(values["root"])
        return cls(**values)


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


class Stack:
    """Embedded Postgres + broker, every service and the gateway as processes. See the module doc."""

    def __init__(self, config: StackConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = StackConfig.from_env(**overrides)
        elif overrides:
            raise TypeError("pass either a StackConfig or keyword overrides, not both")
        self.config = config
        self.root = Path(config.root).absolute()
        self.logs_dir = self.root / "logs"
        self.state_path = self.root / "stack.json"
        self.secrets_path = self.root / "secrets.json"
        self.host = config.host
        self.ports = self._assign_ports()
        self.cancel = threading.Event()  # set it (e.g. from a signal handler) to interrupt start/waits
        self._lock = threading.RLock()
        self._secrets: dict[str, Any] | None = None
        self._started = False
        self.skipped: list[str] = []
        self._broker_down = False  # stop_broker() was called: supervision leaves the broker down
        self.last_replay: list[str] = []  # services whose outbox the last broker restart replayed
        # Outbox rows created since then may sit only on the current (memory-only) broker: what the next
        # start or broker restart replays. Set once services have run against the broker.
        self.replay_from: float | None = None

        unknown = [s for s in config.services if s not in SERVICES]
        if unknown:
            raise StackError(f"unknown services {unknown}; known: {list(SERVICES)}")
        self.services: list[str] = list(config.services)
        names = [*self.services, *([GATEWAY] if config.gateway else [])]
        self._procs: dict[str, ServiceProcess] = {n: ServiceProcess(n, self.ports[n]) for n in names}

        self.pg: EmbeddedPostgres | None = None
        if not config.database_url:
            self.pg = EmbeddedPostgres(
                self.root / "pg", port=self.ports["postgres"], host=self.host, log_path=self.logs_dir / "postgres.log"
            )
        self.agents = LocalAgents(self)
        self.tansu: Tansu | None = None
        self.kafka: ApacheKafka | None = None
        if config.broker not in ("tansu", "kafka"):
            raise StackError(f"unknown broker {config.broker!r}: tansu or kafka")
        if not config.kafka_bootstrap and config.broker == "kafka":
            self.kafka = ApacheKafka(
                self.root / "kafka", port=self.ports["kafka"], host=self.host, log_path=self.logs_dir / "kafka.log"
            )
        elif not config.kafka_bootstrap:
            self.tansu = Tansu(port=self.ports["kafka"], host=self.host, log_path=self.logs_dir / "tansu.log")

    # ----------------------------------------------------------------------------------------- config

    def _assign_ports(self) -> dict[str, int]:
        ports: dict[str, int] = {}
        taken: set[int] = set(self.config.ports.values())
        for name, default in DEFAULT_PORTS.items():
            if name in self.config.ports:
                ports[name] = self.config.ports[name]
            elif self.config.free_ports:
                port = free_port(self.config.host)
                while port in taken:
                    port = free_port(self.config.host)
                taken.add(port)
                ports[name] = port
            else:
                ports[name] = default
        return ports

    @property
    def external_database(self) -> bool:
        return self.pg is None

    @property
    def external_broker(self) -> bool:
        return self.tansu is None and self.kafka is None

    @property
    def gateway_url(self) -> str:
        return f"http://{self.host}:{self.ports[GATEWAY]}"

    @property
    def kafka_bootstrap(self) -> str:
        if self.kafka is not None:
            return self.kafka.bootstrap
        return self.config.kafka_bootstrap or self.tansu.bootstrap  # type: ignore[union-attr]

    @property
    def superuser_url(self) -> str:
        """The superuser's URL of the maintenance database (`postgres`, or the one given)."""
        if self.config.database_url:
            return _plain_url(self.config.database_url)
        assert self.pg is not None
        self.pg.password = self._secret_store()["postgres_password"]
        return self.pg.admin_url

    @property
    def database_admin_url(self) -> str:
        """The superuser's URL of the suite's database (`gpuaas`)."""
        return _with_database(self.superuser_url, self.config.database)

    @property
    def names(self) -> list[str]:
        """Every process the stack runs: the services, then the gateway."""
        return list(self._procs)

    def service_url(self, name: str) -> str:
        if name not in DEFAULT_PORTS or name in ("postgres", "kafka"):
            raise KeyError(f"no such service: {name}")
        return f"http://{self.host}:{self.ports[name]}"

    def pid(self, name: str) -> int | None:
        return self._proc(name).pid

    def is_running(self, name: str) -> bool:
        return self._proc(name).running

    def _proc(self, name: str) -> ServiceProcess:
        try:
            return self._procs[name]
        except KeyError:
            raise KeyError(f"{name} is not part of this stack ({', '.join(self._procs)})") from None

    # ---------------------------------------------------------------------------------------- secrets

    def _secret_store(self) -> dict[str, Any]:
        """<root>/secrets.json: generated once, mode 600; passwords stay stable across runs."""
        if self._secrets is not None:
            return self._secrets
        self.root.mkdir(parents=True, exist_ok=True)
        data = read_json(self.secrets_path)
        changed = not data
        if not data.get("postgres_password"):
            data["postgres_password"] = secrets.token_urlsafe(18)
            changed = True
        services = data.setdefault("services", {})
        for svc in SERVICES:
            if not services.get(svc):
                services[svc] = secrets.token_urlsafe(18)
                changed = True
        admin = data.setdefault("admin", {})
        if not admin.get("password"):
            admin["password"] = secrets.token_urlsafe(12)
            changed = True
        if admin.get("email") != self.config.admin_email:
            admin["email"] = self.config.admin_email
            changed = True
        if changed:
            write_private(self.secrets_path, data)
        self._secrets = data
        return data

    def service_password(self, service: str) -> str:
        if self.config.database_url:
            # Roles are global to a server, and several stacks (test sessions, CI jobs) may share an
            # external one: derive the password from the server's superuser URL so they all agree.
            key = self.config.database_url.encode()
            return hmac.new(key, f"gpuaas-devstack:{service}".encode(), hashlib.sha256).hexdigest()[:32]
        return self._secret_store()["services"][service]

    @property
    def admin_login(self) -> tuple[str, str]:
        """The seeded platform operator (identity bootstraps it at first start)."""
        admin = self._secret_store()["admin"]
        return admin["email"], admin["password"]

    def database_url(self, service: str) -> str:
        """The service's own URL (its role, which can touch only its schema), SQLAlchemy-style."""
        from gpuaas.kit.provision import service_url

        return service_url(self.database_admin_url, service, self.service_password(service))

    # -------------------------------------------------------------------------------------- environment

    def env_for(self, name: str) -> dict[str, str]:
        """The variables the stack sets for a service or the gateway (not the inherited environment)."""
        prefix = f"GPUAAS_{name.upper()}_"
        env = {
            f"{prefix}HOST": self.host,
            f"{prefix}PORT": str(self.ports[name]),
            f"{prefix}LOG_JSON": "true",
            "GPUAAS_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
            "GPUAAS_JWKS_URL": f"{self.service_url('identity')}/.well-known/jwks.json",
            "GPUAAS_JWT_ISSUER": f"{self.gateway_url}/api/identity",
        }
        if name == GATEWAY:
            env[f"{prefix}UPSTREAMS"] = json.dumps({s: self.service_url(s) for s in self.services})
        else:
            env[f"{prefix}DATABASE_URL"] = self.database_url(name)
        if name == "identity":
            email, password = self.admin_login
            env[f"{prefix}BOOTSTRAP_ADMIN_EMAIL"] = email
            env[f"{prefix}BOOTSTRAP_ADMIN_PASSWORD"] = password
            env[f"{prefix}PUBLIC_URL"] = f"{self.gateway_url}/api/identity"
        env.update(self.config.env.get("*", {}))
        env.update(self.config.env.get(name, {}))
        return env

    def _process_env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "GPUAAS_DATABASE_URL"}  # superuser: not for services
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.env_for(name))
        return env

    # ------------------------------------------------------------------------------------------ start

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Stack:
        """Start (or reuse) the infrastructure, provision, migrate, start everything, wait until ready."""
        with self._lock:
            if self._started:
                return self
            t0 = time.monotonic()
            self.cancel.clear()
            self.root.mkdir(parents=True, exist_ok=True)
            self.logs_dir.mkdir(parents=True, exist_ok=True)
            previous = self._take_over_previous()
            self._select_services()
            self._check_ports()
            self._started = True
            try:
                pg_reused = self._start_postgres()
                self._checkpoint()
                self._start_broker()
                self._checkpoint()
                self.provision()
                self._checkpoint()
                self._run_all("migrate")
                self._checkpoint()
                prev_broker = previous.get("broker") or {}
                prev_from = prev_broker.get("replay_from")
                if self.tansu is not None and (pg_reused or self.external_database) and prev_broker.get("embedded"):
                    self.replay_from = prev_from  # kept if this start is interrupted before services run
                    if self.config.replay_on_start and prev_from:
                        # The previous run's broker is gone with whatever its consumers had not read yet.
                        log.info("replaying the outbox published to the previous run's broker")
                        self._replay(float(prev_from))
                for name in self._procs:
                    self._spawn(name)
                if self.tansu is not None:
                    self.replay_from = self.tansu.started_at
                self._write_state()
                self.wait_ready(timeout=self.config.ready_timeout_s)
                self._checkpoint()
                self.agents.start()
                self._write_state()
            except BaseException:
                self.stop()
                raise
            log.info("stack ready in %.1fs", time.monotonic() - t0)
            return self

    def _require_started(self) -> None:
        if not self._started:
            raise StackError("the stack is not started (call start() first)")

    def _checkpoint(self) -> None:
        if self.cancel.is_set():
            raise StackInterrupted("interrupted")

    def _select_services(self) -> None:
        missing = [n for n in self._procs if not module_available(n)]
        if not missing:
            return
        if not self.config.skip_missing:
            raise StackError(
                f"no runnable module for {', '.join(f'gpuaas.{m}' for m in missing)} "
                "(`python -m gpuaas.<name>` needs a __main__); every service is required"
            )
        for m in missing:
            log.warning("skipping %s: gpuaas.%s has no __main__ (skip_missing)", m, m)
            self._procs.pop(m)
            self.skipped.append(m)
            if m in self.services:
                self.services.remove(m)

    def _check_ports(self) -> None:
        wanted = {n: self.ports[n] for n in self._procs}
        if self.pg is not None:
            wanted["postgres"] = self.ports["postgres"]
        if self.tansu is not None or self.kafka is not None:
            wanted["kafka"] = self.ports["kafka"]
        busy = {n: p for n, p in wanted.items() if port_in_use(self.host, p)}
        if busy:
            listing = ", ".join(f"{n} {self.host}:{p}" for n, p in busy.items())
            raise StackError(
                f"ports already in use: {listing}. Is another stack running? "
                "`python -m gpuaas.devstack stop` stops the one recorded in .local/stack.json"
            )

    def _take_over_previous(self) -> dict[str, Any]:
        """Read the previous run's state; refuse a live runner, clean up after a dead one."""
        previous = read_json(self.state_path)
        if not previous.get("running"):
            return previous
        runner = previous.get("runner") or {}
        if runner.get("pid") != os.getpid() and proc_matches(runner.get("pid"), runner.get("create_time")):
            raise StackError(
                f"a stack is already running from {self.root} (runner pid {runner['pid']}); "
                "stop it first: python -m gpuaas.devstack stop"
            )
        leftovers = stop_recorded(previous)
        if leftovers:
            log.warning("stopped processes left by a previous run that did not stop cleanly: %s", leftovers)
        return previous

    def _start_postgres(self) -> bool:
        """Start the embedded server; True when its data directory already existed."""
        if self.pg is None:
            return False
        if os.geteuid() == 0 and "/pytest-of-" in str(self.root):
            log.warning(
                "%s is under pytest's temp root, which pytest resets to mode 700 when another session starts: "
                "Postgres (running as an unprivileged user) then loses its data directory. Use "
                "gpuaas.devstack.testing.temp_root()",
                self.root,
            )
        reused = (self.pg.data_dir / "PG_VERSION").exists()
        self.pg.password = self._secret_store()["postgres_password"]
        log.info("%s embedded Postgres on %s:%s", "reusing" if reused else "initialising", self.host, self.pg.port)
        self.pg.start()
        _run_coro(self.pg.set_superuser_password)
        return reused

    def _start_broker(self) -> None:
        if self.kafka is not None:
            log.info("starting Apache Kafka on %s (log under %s)", self.kafka.bootstrap, self.kafka.data_dir)
            self.kafka.start()
            return
        if self.tansu is None:
            return
        log.info("starting embedded Tansu on %s", self.tansu.bootstrap)
        self.tansu.start()

    def provision(self) -> None:
        """Create the database and every service's role and schema (idempotent)."""
        from gpuaas.kit.provision import ensure_database, ensure_service_schema

        async def run() -> None:
            await ensure_database(self.superuser_url, self.config.database)
            for svc in SERVICES:
                await ensure_service_schema(self.database_admin_url, svc, self.service_password(svc))

        _run_coro(run)

    def migrate(self) -> None:
        """Provision and migrate only (`make migrate`), starting the embedded Postgres if needed."""
        with self._lock:
            self.root.mkdir(parents=True, exist_ok=True)
            self.logs_dir.mkdir(parents=True, exist_ok=True)
            self._select_services()
            own_pg = self.pg is not None and not self.pg.running
            if own_pg and port_in_use(self.host, self.ports["postgres"]):
                # A running stack's Postgres (same root, so same superuser password): use it as it is.
                log.info("using the Postgres already listening on %s:%s", self.host, self.ports["postgres"])
                own_pg = False
            if own_pg:
                self._start_postgres()
            try:
                self.provision()
                self._run_all("migrate", names=self.services)
            finally:
                if own_pg:
                    assert self.pg is not None
                    self.pg.stop()

    # ----------------------------------------------------------------------------------- subprocesses

    def _header(self, name: str, what: str) -> bytes:
        return f"\n=== {datetime.now(UTC).isoformat(timespec='seconds')} devstack: {what} ===\n".encode()

    def _spawn(self, name: str) -> None:
        sp = self._proc(name)
        cmd = [self.config.python, "-m", f"gpuaas.{name}", "serve"]
        with open(self.logs_dir / f"{name}.log", "ab") as logf:
            logf.write(self._header(name, f"serve on {self.host}:{sp.port}"))
            logf.flush()
            sp.proc = subprocess.Popen(
                cmd,
                env=self._process_env(name),
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        sp.wanted = True
        sp.started_mono = time.monotonic()
        sp.restart_due = None
        log.info("started %s (pid %s) on port %s", name, sp.proc.pid, sp.port)

    def _run_all(self, command: str, args: Sequence[str] = (), names: Iterable[str] | None = None) -> None:
        """`python -m gpuaas.<svc> <command> <args>` for each service in parallel; fail with the log tail."""
        names = list(self.services if names is None else names)
        running: dict[str, subprocess.Popen] = {}
        try:
            for name in names:
                with open(self.logs_dir / f"{name}.log", "ab") as logf:
                    logf.write(self._header(name, " ".join([command, *args])))
                    logf.flush()
                    running[name] = subprocess.Popen(
                        [self.config.python, "-m", f"gpuaas.{name}", command, *args],
                        env=self._process_env(name),
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
            deadline = time.monotonic() + 300
            while any(p.poll() is None for p in running.values()):
                self._checkpoint()
                if time.monotonic() > deadline:
                    raise StackError(f"`{command}` did not finish in 300s: {[n for n, p in running.items()]}")
                time.sleep(0.1)
        finally:
            for p in running.values():
                stop_process(p, signal.SIGTERM, 5)
        failed = {n: p.returncode for n, p in running.items() if p.returncode != 0}
        if failed:
            details = "\n\n".join(
                f"--- gpuaas.{n} {command} exited with {rc}; {self.logs_dir / f'{n}.log'}:\n"
                f"{tail(self.logs_dir / f'{n}.log')}"
                for n, rc in failed.items()
            )
            raise StackError(f"`{command}` failed for {', '.join(failed)}\n{details}")
        log.info("%s done: %s", command, ", ".join(names))

    def _replay(self, since_epoch: float) -> list[str]:
        """`replay --since` for each service that published anything since then (to the lost broker).

        Services with nothing to requeue are skipped (a quick query as their role), which saves a
        process start each. Returns the services replayed.
        """
        since = datetime.fromtimestamp(since_epoch - REPLAY_MARGIN_S, UTC)
        names = _run_coro(lambda: self._published_since(since))
        self.last_replay = names
        if names:
            self._run_all("replay", ["--since", since.isoformat()], names=names)
        else:
            log.info("replay: no service published anything since %s", since.isoformat())
        return names

    async def _published_since(self, since: datetime) -> list[str]:
        sql = "SELECT EXISTS (SELECT 1 FROM outbox WHERE created_at >= $1 AND sent_at IS NOT NULL)"
        names = []
        for svc in self.services:
            try:
                if await self.fetchval(svc, sql, since):
                    names.append(svc)
            except Exception as exc:  # cannot tell: let the service's own replay decide
                log.warning("replay check for %s failed (%s); replaying it anyway", svc, exc)
                names.append(svc)
        return names

    def _stop_many(self, names: Iterable[str], timeout_s: float = 20.0) -> None:
        """SIGTERM each group at once, wait together, SIGKILL what is left."""
        procs = [self._proc(n) for n in names]
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

    # ---------------------------------------------------------------------------------------- control

    def stop(self, service: str | None = None, timeout_s: float = 20.0) -> None:
        """Stop one service (SIGTERM, then SIGKILL), or with no argument everything: nothing is left."""
        with self._lock:
            if service is not None:
                self._stop_many([service], timeout_s)
                self._write_state()
                return
            if not self._started:
                return
            self.agents.stop()
            self._stop_many(list(self._procs), timeout_s)
            if self.tansu is not None:
                self.tansu.stop()
            if self.kafka is not None:
                self.kafka.stop()
            if self.pg is not None:
                self.pg.stop()
            self._started = False
            self._write_state(running=False)
            log.info("stack stopped")

    def kill(self, service: str, sig: int = signal.SIGKILL) -> None:
        """Signal a service's process group. Fatal signals wait for the exit and mark it intentionally
        down (supervision leaves it alone); others (SIGSTOP/SIGCONT) are just sent."""
        with self._lock:
            sp = self._proc(service)
            if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
                sp.wanted = False
                if signal_group(sp.proc, sig) and sp.proc is not None:
                    try:
                        sp.proc.wait(30)
                    except subprocess.TimeoutExpired:
                        stop_process(sp.proc, signal.SIGKILL)
                self._write_state()
            else:
                signal_group(sp.proc, sig)

    def start_service(self, service: str, wait: bool = True, timeout: float | None = None) -> None:
        """(Re)start one service; by default wait for its /readyz."""
        with self._lock:
            self._require_started()
            sp = self._proc(service)
            if sp.running:
                self._stop_many([service])
            self._spawn(service)
            sp.failures = 0
            self._write_state()
        if wait:
            self.wait_ready([service], timeout)

    restart_service = start_service

    def restart_broker(self, wait: bool = True, timeout: float | None = None) -> None:
        """Tansu: fresh embedded broker on the same port; restart every service; replay the lost broker's
        log. Apache Kafka: stop and start the broker keeping its log; the services stay up and reconnect."""
        if self.kafka is not None:
            self.stop_broker()
            self.start_broker()
            if wait:
                self.wait_ready(None, timeout)
            return
        if self.tansu is None:
            raise StackError("the broker is external (GPUAAS_KAFKA_BOOTSTRAP): the stack never restarts it")
        with self._lock:
            self._require_started()
            lost_since = self.tansu.started_at
            names = [n for n in self.services if self._procs[n].wanted or self._procs[n].running]
            # Services first, while the broker (if alive) still answers their clean shutdown; with a dead
            # broker their consumers cannot leave cleanly, so do not wait long.
            self._stop_many(names, timeout_s=15.0 if self.tansu.running else 8.0)
            self.tansu.stop()
            self.tansu.start()
            log.warning("broker restarted (fresh, empty) on %s", self.tansu.bootstrap)
            self._replay(min(lost_since, self.replay_from or lost_since))
            for n in names:
                self._spawn(n)
            self.replay_from = self.tansu.started_at
            self._write_state()
        if wait:
            self.wait_ready(names, timeout)

    def stop_broker(self, sig: int = signal.SIGTERM) -> None:
        """Apache Kafka only: stop the broker (SIGTERM: controlled shutdown; SIGKILL: crash) and leave it
        down until start_broker(); the services keep running and must ride it out."""
        if self.kafka is None:
            raise StackError("stop_broker() needs the stack's own Apache Kafka (broker='kafka')")
        with self._lock:
            self._require_started()
            self._broker_down = True
            self.kafka.stop(sig)
            log.warning("Apache Kafka stopped (%s); its log is kept", signal.Signals(sig).name)
            self._write_state()

    def start_broker(self) -> None:
        """Apache Kafka only: start the stopped broker again on the same port with the same log."""
        if self.kafka is None:
            raise StackError("start_broker() needs the stack's own Apache Kafka (broker='kafka')")
        with self._lock:
            self._require_started()
            self.kafka.start()
            self._broker_down = False
            log.warning("Apache Kafka started again on %s", self.kafka.bootstrap)
            self._write_state()

    def restart_postgres(self, wait: bool = True, timeout: float | None = None) -> None:
        """Restart the embedded Postgres (fast shutdown: clients are disconnected); services reconnect."""
        if self.pg is None:
            raise StackError("the database is external (GPUAAS_DATABASE_URL): the stack never restarts it")
        with self._lock:
            self._require_started()
            self.pg.stop()
            self.pg.start()
            self._write_state()
        if wait:
            self.wait_ready(None, timeout)

    def wait_ready(self, services: Iterable[str] | None = None, timeout: float | None = None) -> None:
        """Wait until each one answers 200 on /readyz; on timeout (or exit) name it with its log tail."""
        timeout = self.config.ready_timeout_s if timeout is None else timeout
        pending = {n for n in (self._procs if services is None else services) if n in self._procs}
        last: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=3.0) as client:
            while pending:
                self._checkpoint()
                for name in sorted(pending):
                    sp = self._procs[name]
                    if not sp.running:
                        rc = sp.proc.returncode if sp.proc is not None else None
                        raise StackError(
                            f"{name} is not running (exit code {rc}) — {self.logs_dir / f'{name}.log'}:\n"
                            f"{tail(self.logs_dir / f'{name}.log')}"
                        )
                    try:
                        r = client.get(f"{self.service_url(name)}/readyz")
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
                        f"--- {n}: last /readyz: {last.get(n, '-')}\n{self.logs_dir / f'{n}.log'}:\n"
                        f"{tail(self.logs_dir / f'{n}.log')}"
                        for n in sorted(pending)
                    )
                    raise StackError(f"not ready after {timeout:.0f}s: {', '.join(sorted(pending))}\n{details}")
                time.sleep(0.25)

    # ------------------------------------------------------------------------------------ supervision

    def supervise(self, stop: threading.Event | None = None, interval_s: float = 1.0) -> None:
        """Keep the stack up until `stop` (default `self.cancel`) is set: a dead embedded broker gets the
        restart_broker() sequence, a dead embedded Postgres is restarted, a service that died unexpectedly
        is restarted with backoff. Every action is logged."""
        stop = stop or self.cancel
        while not stop.is_set():
            try:
                self.supervise_once()
            except StackInterrupted:
                return
            except StackError as exc:
                log.error("supervision: %s", exc)
            stop.wait(interval_s)

    def supervise_once(self) -> list[str]:
        """One supervision pass; returns what was restarted ("broker", "postgres" or service names)."""
        actions: list[str] = []
        with self._lock:
            if not self._started:
                return actions
            if self.pg is not None and not self.pg.running:
                rc = self.pg.proc.returncode if self.pg.proc is not None else None
                reap_group(self.pg.proc)
                log.warning("Postgres exited (code %s); restarting it", rc)
                self.pg.start()
                actions.append("postgres")
            if self.tansu is not None and not self.tansu.running:
                rc = self.tansu.proc.returncode if self.tansu.proc is not None else None
                reap_group(self.tansu.proc)
                log.warning(
                    "the broker exited (code %s): everything it held is lost; restarting it, restarting the "
                    "services and replaying their outboxes",
                    rc,
                )
                self.restart_broker(wait=False)
                actions.append("broker")
            if self.kafka is not None and not self.kafka.running and not self._broker_down:
                rc = self.kafka.proc.returncode if self.kafka.proc is not None else None
                reap_group(self.kafka.proc)
                log.warning("Apache Kafka exited (code %s); restarting it (its log is kept)", rc)
                self.kafka.start()
                actions.append("kafka")
            now = time.monotonic()
            for sp in self._procs.values():
                if not sp.wanted or sp.running:
                    continue
                if sp.restart_due is None:
                    reap_group(sp.proc)
                    if now - sp.started_mono >= HEALTHY_UPTIME_S:
                        sp.failures = 0
                    delay = min(MAX_BACKOFF_S, float(2**sp.failures - 1))
                    sp.failures += 1
                    sp.restart_due = now + delay
                    log.warning(
                        "%s exited unexpectedly (code %s); restarting in %.0fs — see %s",
                        sp.name,
                        sp.proc.returncode if sp.proc is not None else None,
                        delay,
                        self.logs_dir / f"{sp.name}.log",
                    )
                if now >= sp.restart_due:
                    self._spawn(sp.name)
                    sp.awaiting_ready = True
                    actions.append(sp.name)
            actions += self.agents.supervise()
            self._log_ready_again()
            if actions:
                self._write_state()
        if "broker" in actions:
            names = [n for n in self.services if self._procs[n].running]
            self.wait_ready(names)
            log.info("services ready again after the broker restart")
        return actions

    def _log_ready_again(self) -> None:
        for sp in self._procs.values():
            if not (sp.awaiting_ready and sp.running):
                continue
            try:
                if httpx.get(f"{self.service_url(sp.name)}/readyz", timeout=1.0).status_code == 200:
                    sp.awaiting_ready = False
                    log.info("%s is ready again (pid %s)", sp.name, sp.pid)
            except httpx.HTTPError:
                pass

    # ------------------------------------------------------------------------------------------ state

    def _write_state(self, running: bool = True) -> None:
        if not self.root.exists():
            return
        write_private(self.state_path, self.state(running))

    def state(self, running: bool = True) -> dict[str, Any]:
        """What stack.json holds: URLs, addresses, pids and the seeded logins."""

        def pinfo(pid: int | None) -> dict[str, Any]:
            return {"pid": pid, "create_time": _create_time(pid)}

        email, password = self.admin_login
        services = {}
        for name in self.services:
            sp = self._procs[name]
            services[name] = {
                "url": self.service_url(name),
                "docs": f"{self.service_url(name)}/docs",
                "port": sp.port,
                "pid": sp.pid if sp.running else None,
                "log": str(self.logs_dir / f"{name}.log"),
            }
        gw = self._procs.get(GATEWAY)
        processes = {n: pinfo(sp.pid if sp.running else None) for n, sp in self._procs.items()}
        db_url = urlsplit(self.database_admin_url)
        data: dict[str, Any] = {
            "version": STATE_VERSION,
            "running": running,
            "root": str(self.root),
            "updated_at": datetime.now(UTC).isoformat(),
            "runner": pinfo(os.getpid()),
            "gateway": {
                "url": self.gateway_url,
                "docs": f"{self.gateway_url}/docs",
                "port": self.ports[GATEWAY],
                "pid": gw.pid if gw and gw.running else None,
                "log": str(self.logs_dir / "gateway.log"),
            },
            "docs": f"{self.gateway_url}/docs",
            "services": services,
            "database": {
                "embedded": self.pg is not None,
                "host": db_url.hostname,
                "port": db_url.port,
                "name": self.config.database,
                "superuser": db_url.username,
                "url": _redact(self.database_admin_url),
                "credentials": str(self.secrets_path),
                "data_dir": str(self.pg.data_dir) if self.pg else None,
                "pid": self.pg.pid if self.pg and self.pg.running else None,
            },
            "broker": {
                "embedded": self.tansu is not None,
                "kind": "kafka" if self.kafka else ("tansu" if self.tansu else "external"),
                "bootstrap": self.kafka_bootstrap,
                "pid": self.tansu.pid if self.tansu and self.tansu.running else None,
                "started_at": self.tansu.started_at if self.tansu else None,
                "replay_from": self.replay_from,
            },
            "logins": {"admin": {"email": email, "password": password}},
            "logs": str(self.logs_dir),
            "secrets": str(self.secrets_path),
            "skipped": list(self.skipped),
            "processes": processes,
            "agents": self.agents.state(),
        }
        for name, info in data["agents"].items():
            processes[f"agent-{name}"] = pinfo(info["pid"])
        if self.pg is not None:
            processes["postgres"] = pinfo(self.pg.pid if self.pg.running else None)
        if self.tansu is not None:
            processes["tansu"] = pinfo(self.tansu.pid if self.tansu.running else None)
        if self.kafka is not None:
            processes["kafka"] = pinfo(self.kafka.pid if self.kafka.running else None)
            data["broker"]["pid"] = self.kafka.pid if self.kafka.running else None
            data["broker"]["log_dir"] = str(self.kafka.log_dir)
        return data

    # --------------------------------------------------------------------------------- test helpers

    async def _connect(self, service: str) -> Any:
        import asyncpg

        return await asyncpg.connect(_plain_url(self.database_url(service)), server_settings={"search_path": service})

    async def fetchval(self, service: str, sql: str, *args: Any) -> Any:
        """One value, queried as the service's own role (it sees only its schema)."""
        conn = await self._connect(service)
        try:
            return await conn.fetchval(sql, *args)
        finally:
            await conn.close()

    async def fetch(self, service: str, sql: str, *args: Any) -> list[Any]:
        conn = await self._connect(service)
        try:
            return await conn.fetch(sql, *args)
        finally:
            await conn.close()

    async def execute(self, service: str, sql: str, *args: Any) -> str:
        conn = await self._connect(service)
        try:
            return await conn.execute(sql, *args)
        finally:
            await conn.close()


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
