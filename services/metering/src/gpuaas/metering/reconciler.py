"""The window closer: records due hourly windows and applies the heartbeat rule, in the background.

Several replicas share the work (FOR UPDATE SKIP LOCKED), each batch in its own short transaction; a
full batch means more meters are due, so the next one is claimed at once rather than after the interval.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gpuaas.kit.app import KitRuntime
from gpuaas.kit.logging import get_logger
from gpuaas.kit.loops import run_periodically
from gpuaas.metering import service
from gpuaas.metering.service import app_hours as app_hours_service
from gpuaas.metering.settings import Settings

log = get_logger(__name__)


async def close_windows_once(kit: KitRuntime, *, now: datetime | None = None) -> bool:
    """One batch of the closer as of `now` (the wall clock unless given); True when the batch was full."""
    s = kit.settings_as(Settings)
    async with kit.sessions() as session, session.begin():
        claimed, written = await service.close_due_windows(
            session,
            now=now or datetime.now(UTC),
            settle=timedelta(seconds=s.window_settle_s),
            grace=timedelta(seconds=s.heartbeat_grace_s),
            limit=s.closer_batch,
        )
    if written:
        log.info("usage_windows_closed", meters=claimed, records=written)
    async with kit.sessions() as session, session.begin():  # launchable apps' app-hours (issue 21)
        app_hours = await app_hours_service.record_app_hours(session, now=now or datetime.now(UTC))
    if app_hours:
        log.info("app_hours_recorded", records=app_hours)
    return claimed >= s.closer_batch


async def window_closer(kit: KitRuntime) -> None:
    interval_s = kit.settings_as(Settings).closer_interval_s
    await run_periodically(kit, "window_closer", interval_s, lambda: close_windows_once(kit))
