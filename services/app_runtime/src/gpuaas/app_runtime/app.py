"""The app_runtime service: `create_app()` and its `SPEC` (routers, handlers, migrations, reconciler)."""

import asyncio
from pathlib import Path

from fastapi import FastAPI

from gpuaas.app_runtime import api, service
from gpuaas.app_runtime.custody import make_custody
from gpuaas.app_runtime.handlers import subscriptions
from gpuaas.app_runtime.models import metadata
from gpuaas.app_runtime.settings import Settings
from gpuaas.kit.app import KitRuntime, ServiceSpec
from gpuaas.kit.app import create_app as kit_create_app
from gpuaas.kit.logging import get_logger

log = get_logger(__name__)


async def _custody(kit: KitRuntime) -> None:
    kit.extras["custody"] = make_custody(kit.settings)  # type: ignore[arg-type]


async def reconciler(kit: KitRuntime) -> None:
    """Requeue operations whose lease expired; force release clearances that are overdue."""
    settings: Settings = kit.settings  # type: ignore[assignment]
    while True:
        try:
            async with kit.sessions() as session, session.begin():
                requeued = await service.expire_leases(session)
            async with kit.sessions() as session, session.begin():
                forced = await service.overdue_releases(session, settings.release_clearance_timeout_s)
            if requeued or forced:
                log.info("reconciled", requeued=requeued, forced_clearances=forced)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # keep reconciling; the next round retries
            log.warning("reconcile_failed", error=str(exc))
        await asyncio.sleep(settings.reconcile_interval_s)


SPEC = ServiceSpec(
    name="app_runtime",
    settings_cls=Settings,
    routers=[api.router],
    subscriptions=subscriptions,
    versions_dir=Path(__file__).parent / "migrations" / "versions",
    metadata=metadata,
    on_startup=[_custody],
    background=[reconciler],
    description="App instances, members, member operations, the controller API and access credentials.",
)


def create_app(settings: Settings | None = None) -> FastAPI:
    return kit_create_app(settings or Settings(), SPEC)
