"""The billing service: `create_app()` and its `SPEC` (routers, handlers, migrations)."""

from pathlib import Path

from fastapi import FastAPI

from gpuaas.billing import SERVICE, api
from gpuaas.billing.handlers import subscriptions
from gpuaas.billing.metrics import BillingMetrics
from gpuaas.billing.models import metadata
from gpuaas.billing.settings import Settings
from gpuaas.kit.app import ServiceSpec
from gpuaas.kit.app import create_app as kit_create_app

SPEC = ServiceSpec(
    name=SERVICE,
    settings_cls=Settings,
    routers=api.routers,
    subscriptions=subscriptions,
    versions_dir=Path(__file__).parent / "migrations" / "versions",
    metadata=metadata,
    metrics=BillingMetrics,
    description="Price book, rating, the ledger, cost views and budgets.",
)


def create_app(settings: Settings | None = None) -> FastAPI:
    return kit_create_app(settings or Settings(), SPEC)
