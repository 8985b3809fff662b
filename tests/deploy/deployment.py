"""The compose deployment (deploy/compose) as the fault tests see it: the gateway through `lb`, each service's schema
in the published Postgres, its containers driven with podman, and the relay leaders read from Postgres' locks.

`Deployment` offers what `tests.faults.workload.Saga` and `check_invariants` use of a devstack `Stack`
(`gateway_url`, `fetch`, `fetchval`, `agent_env`, `logs_dir`, `service_url`), so the fault suite's saga and
invariants run unchanged against the containers. Names follow deploy/compose/README.md: container
`gpuaas-<service>-a|b` for the services (dashes: `app-runtime`) and the gateway, `gpuaas-kafka-1..3`.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from gpuaas.devstack.agents import agent_base_env, write_token_file

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("identity", "allocations", "catalog", "app_runtime", "metering", "billing")
REPLICAS = ("a", "b")
BROKERS = ("kafka-1", "kafka-2", "kafka-3")


def compose_name(service: str) -> str:
    """The compose service / container stem of a service (`app_runtime` → `app-runtime`)."""
    return service.replace("_", "-")


def container(component: str, replica: str | None = None) -> str:
    stem = compose_name(component)
    return f"gpuaas-{stem}-{replica}" if replica else f"gpuaas-{stem}"


def relay_lock_key(schema: str) -> int:
    """gpuaas.kit.relay.advisory_key: the session advisory lock the relay leader holds (pg_locks.objid)."""
    return zlib.crc32(f"gpuaas-relay:{schema}".encode())


class PodmanError(RuntimeError):
    pass


def podman(*args: str, timeout_s: float = 120, check: bool = True) -> str:
    conf = os.environ.get("CONTAINERS_CONF", str(ROOT / "deploy/local/containers.conf"))
    proc = subprocess.run(
        ["podman", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "CONTAINERS_CONF": conf},
    )
    if check and proc.returncode != 0:
        raise PodmanError(f"podman {' '.join(args)}: {proc.returncode} {proc.stderr.strip()[:500]}")
    return proc.stdout.strip()


@dataclass
class Deployment:
    gateway_url: str
    allocations_url: str  # `lb`'s published allocations port, for node agents outside the compose network
    pg_port: int
    secrets: Path
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gpuaas-deploy-test-")))

    @classmethod
    def from_env(cls) -> Deployment | None:
        url = os.environ.get("GPUAAS_DEPLOY_URL")
        if not url:
            return None
        return cls(
            gateway_url=url.rstrip("/"),
            allocations_url=os.environ.get(
                "GPUAAS_DEPLOY_ALLOCATIONS_URL",
                f"http://127.0.0.1:{os.environ.get('GPUAAS_DEPLOY_ALLOCATIONS_PORT', '18002')}",
            ),
            pg_port=int(os.environ.get("GPUAAS_DEPLOY_PG_PORT", "15432")),
            secrets=Path(os.environ.get("GPUAAS_SECRETS_DIR", str(ROOT / ".local/compose/secrets"))),
        )

    # -------------------------------------------------------------------------------- what Saga needs

    @property
    def logs_dir(self) -> Path:
        path = self.root / "logs"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def service_url(self, service: str) -> str:
        """Only the gateway and allocations' agent port are published; diagnostics reach nothing else."""
        return self.allocations_url if service == "allocations" else self.gateway_url

    def agent_env(self, name: str, token: str, gpus: str, **extra: str) -> dict[str, str]:
        """A node agent on this machine (process driver) dialling the deployment's allocations through `lb`."""
        state = self.root / "agents" / name
        state.mkdir(parents=True, exist_ok=True)
        return {
            **agent_base_env(),
            "GPUAAS_AGENT_SERVER_URL": self.allocations_url,
            "GPUAAS_AGENT_NODE_TOKEN_FILE": str(write_token_file(self.root / "agents" / f"{name}.node-token", token)),
            "GPUAAS_AGENT_STATE_DIR": str(state),
            "GPUAAS_AGENT_GPUS": gpus,
            "GPUAAS_AGENT_DRIVER": "process",
            "GPUAAS_AGENT_PREFER_NVIDIA_SMI": "false",
            **extra,
        }

    def _secret(self, name: str) -> str:
        return (self.secrets / name).read_text().strip()

    def database_url(self, service: str) -> str:
        """The service's own URL (its role sees only its schema), pointed at the published Postgres."""
        parts = urlsplit(self._secret(f"{compose_name(service)}-database-url"))
        netloc = parts.netloc.rsplit("@", 1)[0] + f"@127.0.0.1:{self.pg_port}"
        scheme = parts.scheme.split("+", 1)[0]
        return urlunsplit((scheme, netloc, parts.path, parts.query, parts.fragment))

    @property
    def admin_login(self) -> tuple[str, str]:
        """The operator identity bootstraps (deploy/compose/README.md), as the devstack plugin's `gw` logs in."""
        return os.environ.get("GPUAAS_DEPLOY_ADMIN_EMAIL", "admin@gpuaas.example"), self._secret("admin-password")

    async def _connect(self, service: str) -> asyncpg.Connection:
        return await asyncpg.connect(self.database_url(service), server_settings={"search_path": service})

    async def fetch(self, service: str, sql: str, *args: Any) -> list[Any]:
        conn = await self._connect(service)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    async def fetchval(self, service: str, sql: str, *args: Any) -> Any:
        conn = await self._connect(service)
        try:
            return await conn.fetchval(sql, *args)
        finally:
            await conn.close()

    # ------------------------------------------------------------------------------------ containers

    async def relay_leader(self, service: str) -> str | None:
        """The replica (`a`/`b`) whose relay holds the service's advisory lock, from the lock holder's address."""
        rows = await self.fetch(
            service,
            "SELECT host(a.client_addr) AS addr FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.objid = $1::bigint::oid AND l.classid = 0",
            relay_lock_key(service),
        )
        addresses = {r["addr"] for r in rows}
        for replica in REPLICAS:
            if addresses & self.addresses(container(service, replica)):
                return replica
        return None

    @staticmethod
    def addresses(name: str) -> set[str]:
        out = podman(
            "inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}", name, check=False
        )
        return set(out.split())

    @staticmethod
    def running(name: str) -> bool:
        return podman("inspect", "--format", "{{.State.Running}}", name, check=False) == "true"

    @staticmethod
    def kill(name: str) -> None:
        """SIGKILL at once, and stay down (`podman stop -t 0`; a `podman kill` may be restarted by the policy)."""
        podman("stop", "-t", "0", name)

    @staticmethod
    def start(name: str) -> None:
        podman("start", name)

    @staticmethod
    def restart(name: str, grace_s: int = 10) -> None:
        """A graceful restart, as a rolling upgrade does it: SIGTERM, `grace_s` to finish, then start."""
        podman("restart", "-t", str(grace_s), name, timeout_s=grace_s + 120)

    async def wait_ready(self, name: str, timeout_s: float = 180) -> float:
        """Until the component in `name` answers ready (database, broker, consumer group); the seconds it took."""
        started = time.monotonic()
        while True:
            if await asyncio.to_thread(self._ready, name):
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise AssertionError(f"{name} not ready after {timeout_s}s")
            await asyncio.sleep(1.0)

    @staticmethod
    def _ready(name: str) -> bool:
        try:
            podman("exec", name, "/opt/gpuaas/venv/bin/python", "/opt/gpuaas/entrypoint.py", "ready", timeout_s=30)
        except (PodmanError, subprocess.TimeoutExpired):
            return False
        return True
