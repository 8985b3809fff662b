"""The metering service: `create_app()` and its `SPEC` (routers, handlers, migrations)."""

from pathlib import Path

from fastapi import FastAPI

from gpuaas.kit.app import ServiceSpec
from gpuaas.kit.app import create_app as kit_create_app
from gpuaas.metering.settings import Settings

SPEC = ServiceSpec(
    name="metering",
    settings_cls=Settings,
    versions_dir=Path(__file__).parent / "migrations" / "versions",
    description="Meters and usage records from lifecycle events; the app usage producer API.",
)


def create_app(settings: Settings | None = None) -> FastAPI:
    return kit_create_app(settings or Settings(), SPEC)
