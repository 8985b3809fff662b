"""The app_runtime service: `create_app()` and its `SPEC` (routers, handlers, migrations)."""

from pathlib import Path

from fastapi import FastAPI

from gpuaas.app_runtime.settings import Settings
from gpuaas.kit.app import ServiceSpec
from gpuaas.kit.app import create_app as kit_create_app

SPEC = ServiceSpec(
    name="app_runtime",
    settings_cls=Settings,
    versions_dir=Path(__file__).parent / "migrations" / "versions",
    description="App instances, members, member operations and the controller API.",
)


def create_app(settings: Settings | None = None) -> FastAPI:
    return kit_create_app(settings or Settings(), SPEC)
