"""The catalog service: `create_app()` and its `SPEC` (routers, handlers, migrations)."""

from pathlib import Path

from fastapi import FastAPI

from gpuaas.catalog import SERVICE
from gpuaas.catalog.api import routers
from gpuaas.catalog.handlers import subscriptions
from gpuaas.catalog.metrics import CatalogMetrics
from gpuaas.catalog.models import metadata
from gpuaas.catalog.runtime import start_runtime
from gpuaas.catalog.settings import Settings
from gpuaas.kit.app import ServiceSpec
from gpuaas.kit.app import create_app as kit_create_app

SPEC = ServiceSpec(
    name=SERVICE,
    settings_cls=Settings,
    routers=routers,
    subscriptions=subscriptions,
    versions_dir=Path(__file__).parent / "migrations" / "versions",
    metadata=metadata,
    on_startup=[start_runtime],
    metrics=CatalogMetrics,
    description="App manifests, artifact trust and promotion, entitlements.",
)


def create_app(settings: Settings | None = None) -> FastAPI:
    return kit_create_app(settings or Settings(), SPEC)
