"""App-hours of launchable app instances (issue 21), metered by the platform itself (no controller reports).

An instance counts from when it first became `running` (its workload's health check answered) until it
ended (stopped, failed, decommissioned; the instance's `ended_at`). Each hourly window of that span is one
app usage record (unit `app_hours`, quantity = the hours of the window it ran, 6 decimals) whose idempotency
key is `app_hours:<window start>`: its id is `app_usage_record_id(instance, key)`, so a window is recorded
once whatever replica, retry or replay writes it (the insert does nothing on a second try and emits nothing).
Windows are written when they close (the hour passed, or the instance ended), by the window closer loop;
billing rates them with the price of (`app_hours`, app slug) like any app usage.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Actor
from gpuaas.contracts.enums import AppUsageUnit
from gpuaas.contracts.events import usage as usage_events
from gpuaas.kit.outbox import add_events
from gpuaas.metering import SERVICE
from gpuaas.metering.metrics import usage_emitted
from gpuaas.metering.models import app_usage_records, instances

HOUR = timedelta(hours=1)
QUANTITY = Decimal("0.000001")
METERING = Actor.system("metering")


def key_for(window_start: datetime) -> str:
    return f"app_hours:{window_start.isoformat()}"


def windows(start: datetime, end: datetime) -> list[tuple[datetime, datetime, datetime]]:
    """(window start, from, to) for each hourly window of [start, end): the part of it the instance ran."""
    out = []
    w = start.replace(minute=0, second=0, microsecond=0)
    while w < end:
        lo, hi = max(w, start), min(w + HOUR, end)
        if hi > lo:
            out.append((w, lo, hi))
        w += HOUR
    return out


async def record_app_hours(session: AsyncSession, *, now: datetime, limit: int = 200) -> int:
    """Record the closed windows of launchable instances not recorded yet; the number of new records."""
    rows = (
        await session.execute(
            select(instances)
            .where(instances.c.launchable.is_(True), instances.c.running_since.is_not(None))
            .where(
                (instances.c.app_hours_until.is_(None))
                | (instances.c.ended_at.is_not(None) & (instances.c.app_hours_until < instances.c.ended_at))
                | (instances.c.ended_at.is_(None) & (instances.c.app_hours_until < now - HOUR))
            )
            .order_by(instances.c.instance_id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
    ).all()
    written = 0
    for inst in rows:
        # Up to the end, or (still running) up to the last full hour: the open window is written when it closes.
        until = inst.ended_at or now.replace(minute=0, second=0, microsecond=0)
        start = max(inst.running_since, inst.app_hours_until or inst.running_since)
        events = []
        for window_start, lo, hi in windows(start, until):
            # A window partly recorded before (the instance ended inside it after a restart of the count) is
            # not split: its key is the window's, so the first record of it stands.
            key = key_for(window_start)
            record_id = usage_events.app_usage_record_id(inst.instance_id, key)
            quantity = (Decimal((hi - lo).total_seconds()) / Decimal(3600)).quantize(QUANTITY)
            values: dict[str, Any] = {
                "app_usage_record_id": record_id,
                "instance_id": inst.instance_id,
                "tenant_id": inst.tenant_id,
                "project_id": inst.project_id,
                "app_slug": inst.app_slug,
                "member_id": None,
                "unit": str(AppUsageUnit.app_hours),
                "quantity": quantity,
                "idempotency_key": key,
                "occurred_at": hi,
                "reported_by": METERING.id,
            }
            inserted = (
                await session.execute(
                    pg_insert(app_usage_records)
                    .values(values)
                    .on_conflict_do_nothing()
                    .returning(app_usage_records.c.app_usage_record_id)
                )
            ).first()
            if inserted is not None:
                data = usage_events.AppUsageRecord.model_validate(values | {"unit": AppUsageUnit.app_hours})
                events.append(usage_events.AppUsageRecorded.build(data=data, source=SERVICE, actor=METERING))
        if events:
            await add_events(session, events)
            usage_emitted(session, "app", len(events))
            written += len(events)
        if until > start or inst.app_hours_until is None:
            await session.execute(
                update(instances)
                .where(instances.c.instance_id == inst.instance_id)
                .values(app_hours_until=max(until, start))
            )
    return written
