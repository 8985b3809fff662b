"""The metering service: `create_app()` and its `SPEC` (routers, handlers, migrations, window closer)."""

from __future__ import annotations

import asyncio
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from pathlib import Path

from fastapi import FastAPI

from gpuaas.kit.app import KitRuntime, ServiceSpec
from gpuaas.kit.app import create_app as kit_create_app
from gpuaas.kit.logging import get_logger
from gpuaas.metering import api, service
from gpuaas.metering.handlers import subscriptions
from gpuaas.metering.models import metadata
from gpuaas.metering.settings import Settings

log = get_logger(__name__)


async def window_closer(kit: KitRuntime) -> None:
    """Close due hourly windows and apply the heartbeat rule; several replicas share the work
    (FOR UPDATE SKIP LOCKED), each batch in its own short transaction."""
    s: Settings = kit.settings  # type: ignore[assignment]
    while not kit.stopping.is_set():
        claimed = 0
        try:
            async with kit.sessions() as session, session.begin():
                claimed, written = await service.close_due_windows(
                    session,
                    now=datetime.now(UTC),
                    settle=timedelta(seconds=s.window_settle_s),
                    grace=timedelta(seconds=s.heartbeat_grace_s),
                    limit=s.closer_batch,
                )
            if written:
                log.info("usage_windows_closed", meters=claimed, records=written)
        except Exception as exc:  # the database is down: try again next round
            log.warning("window_closer_failed", error=str(exc))
        if claimed >= s.closer_batch:
            continue  # more are due: go on without waiting
        with suppress(TimeoutError):
            await asyncio.wait_for(kit.stopping.wait(), s.closer_interval_s)


SPEC = ServiceSpec(
    name="metering",
    settings_cls=Settings,
    routers=[api.router],
    subscriptions=subscriptions,
    versions_dir=Path(__file__).parent / "migrations" / "versions",
    metadata=metadata,
    background=[window_closer],
    description="Meters and usage records from lifecycle events; the app usage producer API.",
)


def create_app(settings: Settings | None = None) -> FastAPI:
    return kit_create_app(settings or Settings(), SPEC)
