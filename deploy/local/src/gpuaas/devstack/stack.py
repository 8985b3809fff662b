"""The local stack as a library: the runner behind `make run` and the test fixtures both use it.

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

`Stack` is the one entry point; the parts live beside it: `config` (ports, StackConfig), `credentials`
(secrets.json), `processes` (the service processes), `supervision` (restarts, broker loss and outbox
replay), `state` (stack.json), `agents` (local node-agents).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpuaas.devstack.agents import LocalAgents, agent_base_env, write_token_file
from gpuaas.devstack.config import (
    APPS_DOMAIN,
    DEFAULT_PORTS,
    GATEWAY,
    INFRA_PORTS,
    SERVICES,
    StackConfig,
    StackError,
    StackInterrupted,
    assign_ports,
    plain_url,
    redact,
    with_database,
)
from gpuaas.devstack.containers import ContainerKafka
from gpuaas.devstack.credentials import Credentials
from gpuaas.devstack.infra import EmbeddedPostgres, Tansu, port_in_use
from gpuaas.devstack.kafka import ApacheKafka
from gpuaas.devstack.overlay_slots import OverlaySlot
from gpuaas.devstack.processes import Lifecycle, ServiceProcesses, run_coro
from gpuaas.devstack.runtimes import LocalRuntimes, remembered_port, runtimes_wanted
from gpuaas.devstack.state import STATE_VERSION, process_record, take_over_previous, write_private
from gpuaas.devstack.supervision import OutboxReplay, Supervisor
from gpuaas.devstack.vault import LocalVault

__all__ = ["DEFAULT_PORTS", "GATEWAY", "SERVICES", "Stack", "StackConfig", "StackError", "StackInterrupted"]

log = logging.getLogger("gpuaas.devstack")


class Stack:
    """Embedded Postgres + broker, every service and the gateway as processes. See the module doc."""

    def __init__(self, config: StackConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = StackConfig.from_env(**overrides)
        elif overrides:
            raise TypeError("pass either a StackConfig or keyword overrides, not both")
        config.validate()
        self.config = config
        self.root = Path(config.root).absolute()
        self.logs_dir = self.root / "logs"
        self.state_path = self.root / "stack.json"
        self.secrets_path = self.root / "secrets.json"
        self.host = config.host
        self.ports = assign_ports(config)
        previous = remembered_port(self.root)
        if config.free_ports and "registry" not in config.ports and previous and not port_in_use(self.host, previous):
            self.ports["registry"] = previous  # the catalog's runtime references name it
        self._lifecycle = Lifecycle()
        self.cancel = self._lifecycle.cancel  # set it (e.g. from a signal handler) to interrupt start/waits
        self.credentials = Credentials(self.secrets_path, config.admin_email, config.database_url)
        self.overlay_slot = OverlaySlot(self.root)  # claimed by env_for("allocations"), released by stop
        self.services: list[str] = list(config.services)
        names = [*self.services, *([GATEWAY] if config.gateway else [])]
        self.processes = ServiceProcesses(
            names, self.ports, self.host, self.logs_dir, config.python, self._process_env, self._lifecycle
        )

        # GPUAAS_VAULT=openbao: the services' keys from a local OpenBao (gpuaas.devstack.vault).
        self.vault: LocalVault | None = None
        if config.vault == "openbao":
            self.vault = LocalVault(self.root, self.credentials, self.services, self.host)
        self.pg: EmbeddedPostgres | None = None
        if not config.database_url:
            self.pg = EmbeddedPostgres(
                self.root / "pg", port=self.ports["postgres"], host=self.host, log_path=self.logs_dir / "postgres.log"
            )
        self.tansu: Tansu | None = None
        self.kafka: ApacheKafka | ContainerKafka | None = None
        if not config.kafka_bootstrap and config.broker in ("kafka", "testcontainers"):
            kind = ApacheKafka if config.broker == "kafka" else ContainerKafka
            self.kafka = kind(
                self.root / "kafka", port=self.ports["kafka"], host=self.host, log_path=self.logs_dir / "kafka.log"
            )
        elif not config.kafka_bootstrap:
            self.tansu = Tansu(port=self.ports["kafka"], host=self.host, log_path=self.logs_dir / "tansu.log")

        # The registry and runtime images (seeded in the catalog as the operator identity seeds).
        self.runtimes = LocalRuntimes(
            runtimes_wanted(config, self.services),
            self.root,
            self.ports["registry"],
            self.credentials,
            self.service_url,
            agent_driver=config.agent_driver,
        )
        # The agents enrol through allocations as the operator that identity seeds.
        with_agents = {"allocations", "identity"} <= set(self.services)
        self.agents = LocalAgents(
            config.agents if with_agents else (),
            self.root,
            self.logs_dir,
            self.host,
            config.python,
            self.credentials,
            self.service_url,
            extra_env=self.runtimes.agent_env,
        )
        self._outbox = OutboxReplay(self.processes, self.services, self.fetchval)
        self.supervisor = Supervisor(
            self._lifecycle,
            self.processes,
            self.services,
            self.pg,
            self.tansu,
            self.kafka,
            self.agents,
            self._outbox,
            on_change=self._write_state,
            ready_timeout_s=config.ready_timeout_s,
        )

    # ---------------------------------------------------------------------------------- addresses

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
        if self.config.kafka_bootstrap:
            return self.config.kafka_bootstrap
        if self.tansu is None:
            raise RuntimeError("the stack's broker is not started")
        return self.tansu.bootstrap

    @property
    def superuser_url(self) -> str:
        """The superuser's URL of the maintenance database (`postgres`, or the one given)."""
        if self.config.database_url:
            return plain_url(self.config.database_url)
        assert self.pg is not None
        self.pg.password = self.credentials.postgres_password
        return self.pg.admin_url

    @property
    def database_admin_url(self) -> str:
        """The superuser's URL of the suite's database (`gpuaas`)."""
        return with_database(self.superuser_url, self.config.database)

    @property
    def names(self) -> list[str]:
        """Every process the stack runs: the services, then the gateway."""
        return self.processes.names

    def service_url(self, name: str) -> str:
        if name not in DEFAULT_PORTS or name in INFRA_PORTS:
            raise KeyError(f"no such service: {name}")
        return f"http://{self.host}:{self.ports[name]}"

    def agent_env(self, name: str, token: str, gpus: str, **extra: str) -> dict[str, str]:
        """The environment of a node agent a test or bench starts itself for host `name`: its node token in
        a 0600 file (never the environment), its own state dir, and the stack's runtime driver settings."""
        state = self.root / "agents" / name
        state.mkdir(parents=True, exist_ok=True)
        token_file = write_token_file(self.root / "agents" / f"{name}.node-token", token)
        return {
            **agent_base_env(),
            "GPUAAS_AGENT_SERVER_URL": self.service_url("allocations"),
            "GPUAAS_AGENT_NODE_TOKEN_FILE": str(token_file),
            "GPUAAS_AGENT_STATE_DIR": str(state),
            "GPUAAS_AGENT_GPUS": gpus,
            "GPUAAS_AGENT_PREFER_NVIDIA_SMI": "false",
            **self.runtimes.agent_env(),
            **extra,
        }

    def pid(self, name: str) -> int | None:
        return self.processes.get(name).pid

    def is_running(self, name: str) -> bool:
        return self.processes.get(name).running

    @property
    def admin_login(self) -> tuple[str, str]:
        """The seeded platform operator (identity bootstraps it at first start)."""
        return self.credentials.admin_login

    def service_password(self, service: str) -> str:
        return self.credentials.service_password(service)

    def database_url(self, service: str) -> str:
        """The service's own URL (its role, which can touch only its schema), SQLAlchemy-style."""
        from gpuaas.kit.provision import service_url

        return service_url(self.database_admin_url, service, self.service_password(service))

    @property
    def last_replay(self) -> list[str]:
        """Services whose outbox the last broker restart (or start) replayed."""
        return self._outbox.last

    @property
    def replay_from(self) -> float | None:
        """From when outbox rows may sit only on the current memory-only broker (see supervision)."""
        return self.supervisor.replay_from

    # -------------------------------------------------------------------------------- environment

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
            env[f"{prefix}APPS_DOMAIN"] = APPS_DOMAIN
            env[f"{prefix}PUBLIC_URL"] = self.gateway_url
        else:
            env[f"{prefix}DATABASE_URL"] = self.database_url(name)
            if self.vault is not None and self.vault.roles:  # set up by start(): keys from the local OpenBao
                env.update(self.vault.env(name))
            else:
                env["GPUAAS_SECRETS_KEYS"] = self.credentials.secrets_keys
                env[f"{prefix}EVENT_SIGNING_KEY"] = self.credentials.event_signing_key(name)
            env["GPUAAS_EVENT_VERIFY_KEYS"] = self.credentials.event_verify_keys
        if name == "allocations":  # a pool of its own: other stacks' agents may share this machine's kernel
            env.update(self.overlay_slot.env())
        if name in (GATEWAY, "allocations"):  # launchable apps' workload secrets (gpuaas.kit.workload_tokens)
            env["GPUAAS_WORKLOAD_TOKEN_KEY"] = self.credentials.workload_token_key
        if name == "identity":
            email, password = self.admin_login
            env[f"{prefix}BOOTSTRAP_ADMIN_EMAIL"] = email
            env[f"{prefix}BOOTSTRAP_ADMIN_PASSWORD"] = password
            env[f"{prefix}PUBLIC_URL"] = f"{self.gateway_url}/api/identity"
            # Logins reach identity through the gateway on this host: believe the X-Forwarded-For it sets, so each
            # login counts against its client's address, not the gateway's (issue 28).
            env[f"{prefix}TRUSTED_PROXIES"] = json.dumps(sorted({"127.0.0.1", "::1", self.host} - {"0.0.0.0", "::"}))
            # The devstack's enterprise IdPs (a second identity, Keycloak) listen on loopback over plain
            # http: allowed here explicitly; a real deployment's default denies both (outbound guard).
            env[f"{prefix}IDP_ALLOWED_NETWORKS"] = json.dumps(["127.0.0.0/8", "::1/128"])
            env[f"{prefix}IDP_PLAIN_HTTP_HOSTS"] = json.dumps(["127.0.0.1", "localhost", "::1"])
            env[f"{prefix}IDP_TIMEOUT_S"] = "60"  # a local Keycloak on a loaded dev machine answers slowly
        env.update(self.config.env.get("*", {}))
        env.update(self.config.env.get(name, {}))
        return env

    def _process_env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "GPUAAS_DATABASE_URL"}  # superuser: not for services
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.env_for(name))
        return env

    # -------------------------------------------------------------------------------------- start

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Stack:
        """Start (or reuse) the infrastructure, provision, migrate, start everything, wait until ready."""
        lc = self._lifecycle
        with lc.lock:
            if lc.started:
                return self
            t0 = time.monotonic()
            self.cancel.clear()
            self.root.mkdir(parents=True, exist_ok=True)
            self.logs_dir.mkdir(parents=True, exist_ok=True)
            previous = take_over_previous(self.state_path)
            self._check_ports()
            lc.started = True
            try:
                self.runtimes.start()  # the registry now; images build and push while the rest starts
                pg_reused = self._start_postgres()
                lc.checkpoint()
                self._start_broker()
                lc.checkpoint()
                if self.vault is not None:
                    self.vault.start()
                self.provision()
                lc.checkpoint()
                self.processes.run_all("migrate", [], self.services)
                lc.checkpoint()
                self._replay_previous_broker(previous, pg_reused)
                for name in self.processes.names:
                    self.processes.spawn(name)
                if self.tansu is not None:
                    self.supervisor.replay_from = self.tansu.started_at
                self._write_state()
                self.wait_ready(timeout=self.config.ready_timeout_s)
                lc.checkpoint()
                self.runtimes.start_seed()  # the default runtime before start() returns, the others after
                self.agents.start()
                self.runtimes.wait_seeded(default_only=True)
                lc.checkpoint()
                self._write_state()
            except BaseException:
                self.stop()
                raise
            log.info("stack ready in %.1fs", time.monotonic() - t0)
            return self

    def _replay_previous_broker(self, previous: dict[str, Any], pg_reused: bool) -> None:
        """The previous run's embedded broker is gone with whatever its consumers had not read yet."""
        prev_broker = previous.get("broker") or {}
        prev_from = prev_broker.get("replay_from")
        if self.tansu is not None and (pg_reused or self.external_database) and prev_broker.get("embedded"):
            self.supervisor.replay_from = prev_from  # kept if this start is interrupted before services run
            if self.config.replay_on_start and prev_from:
                log.info("replaying the outbox published to the previous run's broker")
                self._outbox.replay(float(prev_from))

    def _check_ports(self) -> None:
        wanted = {n: self.ports[n] for n in self.processes.names}
        if self.pg is not None:
            wanted["postgres"] = self.ports["postgres"]
        if self.tansu is not None or self.kafka is not None:
            wanted["kafka"] = self.ports["kafka"]
        if self.runtimes.enabled:
            wanted["registry"] = self.ports["registry"]
        busy = {n: p for n, p in wanted.items() if port_in_use(self.host, p)}
        if busy:
            listing = ", ".join(f"{n} {self.host}:{p}" for n, p in busy.items())
            raise StackError(
                f"ports already in use: {listing}. Is another stack running? "
                "`python -m gpuaas.devstack stop` stops the one recorded in .local/stack.json"
            )

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
        self.pg.password = self.credentials.postgres_password
        log.info("%s embedded Postgres on %s:%s", "reusing" if reused else "initialising", self.host, self.pg.port)
        self.pg.start()
        run_coro(self.pg.set_superuser_password)
        return reused

    def _start_broker(self) -> None:
        if self.kafka is not None:
            log.info("starting Apache Kafka on %s (log under %s)", self.kafka.bootstrap, self.kafka.data_dir)
            self.kafka.start()
        elif self.tansu is not None:
            log.info("starting embedded Tansu on %s", self.tansu.bootstrap)
            self.tansu.start()

    def provision(self) -> None:
        """Create the database and every service's role and schema (idempotent)."""
        from gpuaas.kit.provision import ensure_database, ensure_service_schema

        async def run() -> None:
            await ensure_database(self.superuser_url, self.config.database)
            for svc in SERVICES:
                await ensure_service_schema(self.database_admin_url, svc, self.service_password(svc))

        run_coro(run)

    def migrate(self) -> None:
        """Provision and migrate only (`make migrate`), starting the embedded Postgres if needed."""
        with self._lifecycle.lock:
            self.root.mkdir(parents=True, exist_ok=True)
            self.logs_dir.mkdir(parents=True, exist_ok=True)
            own_pg = self.pg is not None and not self.pg.running
            if own_pg and port_in_use(self.host, self.ports["postgres"]):
                # A running stack's Postgres (same root, so same superuser password): use it as it is.
                log.info("using the Postgres already listening on %s:%s", self.host, self.ports["postgres"])
                own_pg = False
            if own_pg:
                self._start_postgres()
            try:
                self.provision()
                self.processes.run_all("migrate", [], self.services)
            finally:
                if own_pg:
                    assert self.pg is not None
                    self.pg.stop()

    # ------------------------------------------------------------------------------------ control

    def stop(self, service: str | None = None, timeout_s: float = 20.0) -> None:
        """Stop one service (SIGTERM, then SIGKILL), or with no argument everything: nothing is left."""
        lc = self._lifecycle
        with lc.lock:
            if service is not None:
                self.processes.stop([service], timeout_s)
                self._write_state()
                return
            self.overlay_slot.release()  # (claimed by env_for even when the stack never started)
            if not lc.started:
                return
            self.agents.stop()
            self.processes.stop(self.processes.names, timeout_s)
            if self.vault is not None:
                self.vault.stop()
            self.runtimes.stop()
            if self.tansu is not None:
                self.tansu.stop()
            if self.kafka is not None:
                self.kafka.stop()
            if self.pg is not None:
                self.pg.stop()
            lc.started = False
            self._write_state(running=False)
            log.info("stack stopped")

    def kill(self, service: str, sig: int = signal.SIGKILL) -> None:
        """Signal a service's process group. Fatal signals wait for the exit and mark it intentionally
        down (supervision leaves it alone); others (SIGSTOP/SIGCONT) are just sent."""
        with self._lifecycle.lock:
            self.processes.kill(service, sig)
            if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
                self._write_state()

    def start_service(self, service: str, wait: bool = True, timeout: float | None = None) -> None:
        """(Re)start one service; by default wait for its /readyz."""
        with self._lifecycle.lock:
            self._lifecycle.require_started()
            sp = self.processes.get(service)
            if sp.running:
                self.processes.stop([service])
            self.processes.spawn(service)
            sp.failures = 0
            self._write_state()
        if wait:
            self.wait_ready([service], timeout)

    restart_service = start_service

    def restart_broker(self, wait: bool = True, timeout: float | None = None) -> None:
        """Tansu: fresh embedded broker on the same port; restart every service; replay the lost broker's
        log. Apache Kafka: stop and start the broker keeping its log; the services stay up and reconnect."""
        self.supervisor.restart_broker(wait, timeout)

    def stop_broker(self, sig: int = signal.SIGTERM) -> None:
        """Apache Kafka only: stop the broker and leave it down until start_broker()."""
        self.supervisor.stop_broker(sig)

    def start_broker(self) -> None:
        """Apache Kafka only: start the stopped broker again on the same port with the same log."""
        self.supervisor.start_broker()

    def restart_postgres(self, wait: bool = True, timeout: float | None = None) -> None:
        """Restart the embedded Postgres (fast shutdown: clients are disconnected); services reconnect."""
        if self.pg is None:
            raise StackError("the database is external (GPUAAS_DATABASE_URL): the stack never restarts it")
        with self._lifecycle.lock:
            self._lifecycle.require_started()
            self.pg.stop()
            self.pg.start()
            self._write_state()
        if wait:
            self.wait_ready(None, timeout)

    def wait_ready(self, services: Iterable[str] | None = None, timeout: float | None = None) -> None:
        """Wait until each one answers 200 on /readyz; on timeout (or exit) name it with its log tail."""
        self.processes.wait_ready(services, self.config.ready_timeout_s if timeout is None else timeout)

    def supervise(self, stop: threading.Event | None = None, interval_s: float = 1.0) -> None:
        """Keep the stack up until `stop` (default `self.cancel`) is set (see supervision.Supervisor)."""
        self.supervisor.supervise(stop, interval_s)

    def supervise_once(self) -> list[str]:
        """One supervision pass; returns what was restarted ("broker", "postgres" or service names)."""
        return self.supervisor.supervise_once()

    # -------------------------------------------------------------------------------------- state

    def _write_state(self, running: bool = True) -> None:
        if not self.root.exists():
            return
        write_private(self.state_path, self.state(running))

    def state(self, running: bool = True) -> dict[str, Any]:
        """What stack.json holds: URLs, addresses, pids and the seeded logins."""
        email, password = self.admin_login
        services = {
            name: {
                "url": self.service_url(name),
                "docs": f"{self.service_url(name)}/docs",
                "port": self.ports[name],
                "pid": self.processes.live_pid(name),
                "log": str(self.processes.log_path(name)),
            }
            for name in self.services
        }
        processes = {n: process_record(self.processes.live_pid(n)) for n in self.processes.names}
        db_url = urlsplit(self.database_admin_url)
        agents = self.agents.state()
        data: dict[str, Any] = {
            "version": STATE_VERSION,
            "running": running,
            "root": str(self.root),
            "updated_at": datetime.now(UTC).isoformat(),
            "runner": process_record(os.getpid()),
            "gateway": {
                "url": self.gateway_url,
                "docs": f"{self.gateway_url}/docs",
                "port": self.ports[GATEWAY],
                "pid": self.processes.live_pid(GATEWAY),
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
                "url": redact(self.database_admin_url),
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
            "processes": processes,
            "agents": agents,
            "registry": self.runtimes.state(),
        }
        if data["registry"] is not None:
            processes["registry"] = process_record(data["registry"]["pid"])
        for name, info in agents.items():
            processes[f"agent-{name}"] = process_record(info["pid"])
        if self.pg is not None:
            processes["postgres"] = process_record(self.pg.pid if self.pg.running else None)
        if self.tansu is not None:
            processes["tansu"] = process_record(self.tansu.pid if self.tansu.running else None)
        if self.kafka is not None:
            processes["kafka"] = process_record(self.kafka.pid if self.kafka.running else None)
            data["broker"]["pid"] = self.kafka.pid if self.kafka.running else None
            data["broker"]["log_dir"] = str(self.kafka.log_dir)
        return data

    # ------------------------------------------------------------------------------- test helpers

    async def _connect(self, service: str) -> Any:
        import asyncpg

        return await asyncpg.connect(plain_url(self.database_url(service)), server_settings={"search_path": service})

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
