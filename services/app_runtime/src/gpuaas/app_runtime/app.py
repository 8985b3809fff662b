"""The app_runtime service: `create_app()` and its `SPEC` (routers, handlers, migrations, reconciler)."""

from pathlib import Path

from fastapi import FastAPI

from gpuaas.app_runtime import SERVICE
from gpuaas.app_runtime.api import routers
from gpuaas.app_runtime.handlers import subscriptions
from gpuaas.app_runtime.metrics import AppRuntimeMetrics
from gpuaas.app_runtime.models import metadata
from gpuaas.app_runtime.reconciler import reconciler
from gpuaas.app_runtime.runtime import start_runtime_state
from gpuaas.app_runtime.settings import Settings
from gpuaas.kit.app import ServiceSpec
from gpuaas.kit.app import create_app as kit_create_app

SPEC = ServiceSpec(
    name=SERVICE,
    settings_cls=Settings,
    routers=routers,
    subscriptions=subscriptions,
    versions_dir=Path(__file__).parent / "migrations" / "versions",
    metadata=metadata,
    on_startup=[start_runtime_state],
    secrets_at_rest=True,  # credential custody's key-encryption keys
    background=[reconciler],
    metrics=AppRuntimeMetrics,
    description="App instances, members, member operations, the controller API and access credentials.",
)


def create_app(settings: Settings | None = None) -> FastAPI:
    return kit_create_app(settings or Settings(), SPEC)
