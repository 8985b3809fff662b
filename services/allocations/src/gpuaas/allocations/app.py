"""The allocations service: `create_app()` and its `SPEC` (routers, handlers, migrations, loops)."""

from pathlib import Path

from fastapi import FastAPI

from gpuaas.allocations import SERVICE, api
from gpuaas.allocations.handlers import subscriptions
from gpuaas.allocations.metrics import AllocationsMetrics
from gpuaas.allocations.models import metadata
from gpuaas.allocations.reconciler import admission_loop, listen_for_tasks, reconciler
from gpuaas.allocations.runtime import start_runtime
from gpuaas.allocations.settings import Settings
from gpuaas.kit.app import ServiceSpec
from gpuaas.kit.app import create_app as kit_create_app

SPEC = ServiceSpec(
    name=SERVICE,
    settings_cls=Settings,
    routers=api.routers,
    subscriptions=subscriptions,
    versions_dir=Path(__file__).parent / "migrations" / "versions",
    metadata=metadata,
    on_startup=[start_runtime],
    secrets_at_rest=True,  # the terminal SSH CA key
    background=[reconciler, listen_for_tasks, admission_loop],
    metrics=AllocationsMetrics,
    description="GPU hosts, placement, the allocation lifecycle, SSH access, storage and the browser terminal.",
)


def create_app(settings: Settings | None = None) -> FastAPI:
    return kit_create_app(settings or Settings(), SPEC)
