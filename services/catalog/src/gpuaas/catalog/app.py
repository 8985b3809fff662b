"""The catalog service: `create_app()` and its `SPEC` (routers, handlers, migrations)."""

from pathlib import Path

from fastapi import FastAPI
from prometheus_client import Counter

from gpuaas.catalog import api
from gpuaas.catalog.handlers import subscriptions
from gpuaas.catalog.models import metadata
from gpuaas.catalog.settings import Settings
from gpuaas.kit.app import KitRuntime, ServiceSpec
from gpuaas.kit.app import create_app as kit_create_app


async def _metrics(kit: KitRuntime) -> None:
    """Domain counters on the app's registry (`gpuaas_catalog_*`)."""
    r = kit.metrics.registry
    kit.extras["verifications"] = Counter(
        "gpuaas_catalog_artifact_verifications_total", "Registry content verifications", ["outcome"], registry=r
    )
    kit.extras["transitions"] = Counter(
        "gpuaas_catalog_artifact_transitions_total", "Artifact lifecycle moves", ["to"], registry=r
    )


SPEC = ServiceSpec(
    name="catalog",
    settings_cls=Settings,
    routers=[api.router],
    subscriptions=subscriptions,
    versions_dir=Path(__file__).parent / "migrations" / "versions",
    metadata=metadata,
    on_startup=[_metrics],
    description="App manifests, artifact trust and promotion, entitlements.",
)


def create_app(settings: Settings | None = None) -> FastAPI:
    return kit_create_app(settings or Settings(), SPEC)
