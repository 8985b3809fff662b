"""What a stack is made of: its processes, default ports, configuration and errors (no I/O here)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from gpuaas.devstack.infra import free_port

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
    "registry": 5050,  # the local OCI registry of the runtime images (see runtimes.py)
}
# Each launchable app on its own origin, `<instance id>.apps.localhost:<gateway port>` (browsers resolve
# *.localhost to loopback): gpuaas.gateway.app_origins.
APPS_DOMAIN = "apps.localhost"
# Ports of infrastructure, not of services (service_url refuses them).
INFRA_PORTS = ("postgres", "kafka", "registry")
AGENT_DRIVERS = ("container", "process")
DEFAULT_ROOT = Path(".local")
# The seeded operator. `.example` (RFC 2606) is reserved for examples yet accepted by email validation, which
# refuses the special-use names (`.local`, `.test`, `.localhost`, `.invalid`): identity's discovery (`gpuaas login`,
# the console's login) validates the address, so the printed login must pass it.
DEFAULT_ADMIN_EMAIL = "admin@gpuaas.example"
# Local node-agents (name, declared GPUs) that `make run` enrols so that a new user can allocate at once.
DEFAULT_AGENTS: tuple[tuple[str, str], ...] = (("local-h100", "8xH100-80GB"), ("local-a100", "4xA100-80GB"))
BROKERS = ("tansu", "kafka", "testcontainers")


class StackError(RuntimeError):
    """The stack could not do what was asked; the message says which process and why."""


class StackInterrupted(StackError):
    """`Stack.cancel` was set (Ctrl-C in the runner) while the stack was starting or waiting."""


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
    # After a restart of the stack on existing data, replay what the previous (lost) broker had.
    replay_on_start: bool = True
    python: str = sys.executable
    # The broker the stack runs when no kafka_bootstrap is given: "tansu" (embedded, memory only) or
    # "kafka" (Apache Kafka 4.x KRaft under <root>/kafka, whose log survives restart_broker()), or
    # "testcontainers" (the same Kafka in a container: gpuaas.devstack.containers; the test plugin then also
    # runs Postgres in one).
    broker: str = "tansu"
    # Local node-agents (name, declared GPUs) enrolled and started once the services are ready.
    agents: Sequence[tuple[str, str]] = DEFAULT_AGENTS
    # The OCI registry + runtime images (built, pushed, seeded in the catalog): None = when podman is
    # installed and the stack runs the catalog. Env GPUAAS_STACK_RUNTIME_IMAGES=0/1.
    runtime_images: bool | None = None
    # The node agents' runtime driver: None = container when the runtime images are there, else process.
    # Env GPUAAS_STACK_AGENT_DRIVER=container|process.
    agent_driver: str | None = None
    # Where the services' keys come from: "" (the environment: secrets.json) or "openbao" (a local OpenBao the
    # stack runs and sets up: gpuaas.devstack.vault). Env GPUAAS_VAULT=openbao.
    vault: str = ""

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> StackConfig:
        """Defaults, then `GPUAAS_DATABASE_URL` / `GPUAAS_KAFKA_BOOTSTRAP`, then explicit overrides."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {
            "database_url": env.get("GPUAAS_DATABASE_URL") or None,
            "kafka_bootstrap": env.get("GPUAAS_KAFKA_BOOTSTRAP") or None,
            "broker": env.get("GPUAAS_STACK_BROKER") or "tansu",
            "runtime_images": _flag(env.get("GPUAAS_STACK_RUNTIME_IMAGES")),
            "agent_driver": env.get("GPUAAS_STACK_AGENT_DRIVER") or None,
            "vault": env.get("GPUAAS_VAULT") or "",
            **overrides,
        }
        if "root" in values:
            values["root"] = Path(values["root"])
        return cls(**values)

    def validate(self) -> None:
        unknown = [s for s in self.services if s not in SERVICES]
        if unknown:
            raise StackError(f"unknown services {unknown}; known: {list(SERVICES)}")
        if self.broker not in BROKERS:
            raise StackError(f"unknown broker {self.broker!r}: tansu, kafka or testcontainers")
        if self.vault not in ("", "openbao"):
            raise StackError(f"unknown vault {self.vault!r}: openbao, or unset for the environment's keys")
        if self.agent_driver not in (None, *AGENT_DRIVERS):
            raise StackError(f"unknown agent driver {self.agent_driver!r}: container or process")


def _flag(value: str | None) -> bool | None:
    if value is None or value.strip() == "":
        return None
    return value.strip().lower() not in ("0", "false", "no", "off")


def assign_ports(config: StackConfig) -> dict[str, int]:
    """A port per process name: the override, else a distinct free port (free_ports), else the default."""
    ports: dict[str, int] = {}
    taken: set[int] = set(config.ports.values())
    for name, default in DEFAULT_PORTS.items():
        if name in config.ports:
            ports[name] = config.ports[name]
        elif config.free_ports:
            port = free_port(config.host)
            while port in taken:
                port = free_port(config.host)
            taken.add(port)
            ports[name] = port
        else:
            ports[name] = default
    return ports


def plain_url(url: str) -> str:
    """A libpq URL (`postgresql://`) from a SQLAlchemy-style one (`postgresql+asyncpg://`)."""
    scheme, rest = url.split("://", 1)
    return "postgresql://" + rest if scheme.startswith("postgres") else url


def with_database(url: str, database: str) -> str:
    p = urlsplit(plain_url(url))
    return urlunsplit((p.scheme, p.netloc, f"/{database}", p.query, ""))


def redact(url: str) -> str:
    p = urlsplit(url)
    if p.password is None:
        return url
    return urlunsplit(p._replace(netloc=p.netloc.replace(f":{p.password}@", ":***@")))
