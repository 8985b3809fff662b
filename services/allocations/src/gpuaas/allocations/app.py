"""The allocations service: `create_app()` and its `SPEC` (routers, handlers, migrations)."""

from pathlib import Path

from fastapi import FastAPI

from gpuaas.allocations import api
from gpuaas.allocations.models import metadata
from gpuaas.allocations.settings import Settings
from gpuaas.kit.app import ServiceSpec
from gpuaas.kit.app import create_app as kit_create_app

SPEC = ServiceSpec(
    name="allocations",
    settings_cls=Settings,
    routers=[api.router],
    versions_dir=Path(__file__).parent / "migrations" / "versions",
    metadata=metadata,
    description="GPU hosts, placement and the allocation lifecycle.",
)


def create_app(settings: Settings | None = None) -> FastAPI:
    return kit_create_app(settings or Settings(), SPEC)
