"""The allocations service: `create_app()` and its `SPEC` (routers, handlers, migrations, loops)."""

from pathlib import Path
from typing import Any

from fastapi import FastAPI

from gpuaas.allocations import agent_api, api, terminal
from gpuaas.allocations.handlers import subscriptions
from gpuaas.allocations.models import metadata
from gpuaas.allocations.reconciler import reconciler
from gpuaas.allocations.settings import Settings
from gpuaas.kit.app import ServiceSpec
from gpuaas.kit.app import create_app as kit_create_app


async def _runtime(kit: Any) -> None:
    kit.extras["wakeups"] = agent_api.Wakeups()
    await terminal.load_ca(kit)


SPEC = ServiceSpec(
    name="allocations",
    settings_cls=Settings,
    routers=[api.router, agent_api.router, terminal.router],
    subscriptions=subscriptions,
    versions_dir=Path(__file__).parent / "migrations" / "versions",
    metadata=metadata,
    on_startup=[_runtime],
    background=[reconciler, agent_api.listen_for_tasks],
    description="GPU hosts, placement, the allocation lifecycle, SSH access, storage and the browser terminal.",
)


def create_app(settings: Settings | None = None) -> FastAPI:
    return kit_create_app(settings or Settings(), SPEC)
