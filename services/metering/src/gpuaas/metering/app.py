"""The metering service: `create_app()` and its `SPEC` (routers, handlers, migrations, window closer)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI

from gpuaas.kit.app import ServiceSpec
from gpuaas.kit.app import create_app as kit_create_app
from gpuaas.metering import SERVICE, api
from gpuaas.metering.handlers import subscriptions
from gpuaas.metering.metrics import MeteringMetrics
from gpuaas.metering.models import metadata
from gpuaas.metering.reconciler import window_closer
from gpuaas.metering.settings import Settings

SPEC = ServiceSpec(
    name=SERVICE,
    settings_cls=Settings,
    routers=api.routers,
    subscriptions=subscriptions,
    versions_dir=Path(__file__).parent / "migrations" / "versions",
    metadata=metadata,
    metrics=MeteringMetrics,
    background=[window_closer],
    description="Meters and usage records from lifecycle events; the app usage producer API.",
)


def create_app(settings: Settings | None = None) -> FastAPI:
    return kit_create_app(settings or Settings(), SPEC)
