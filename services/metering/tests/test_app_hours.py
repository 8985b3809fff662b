"""App-hours of launchable instances (issue 21): one record per hourly window the instance ran, with the
hours it ran in it, written once whatever repeats the closer (deterministic key per instance and window)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from sqlalchemy import insert, select, text

from gpuaas.contracts.events.usage import app_usage_record_id
from gpuaas.metering.models import app_usage_records, instances
from gpuaas.metering.service.app_hours import key_for, record_app_hours, windows

pytestmark = pytest.mark.integration

T = datetime(2026, 11, 2, tzinfo=UTC)


def at(h: int, m: int = 0) -> datetime:
    return T.replace(hour=h, minute=m)


def test_windows_split_the_running_span_by_hour() -> None:
    assert windows(at(10, 20), at(12, 50)) == [
        (at(10), at(10, 20), at(11)),
        (at(11), at(11), at(12)),
        (at(12), at(12), at(12, 50)),
    ]
    assert windows(at(10, 20), at(10, 20)) == []


async def _instance(kit, w, **values) -> uuid.UUID:
    iid = uuid.uuid4()
    async with kit.sessions() as s, s.begin():
        await s.execute(
            insert(instances).values(
                instance_id=iid,
                tenant_id=uuid.UUID(str(w["t1"])),
                project_id=uuid.UUID(str(w["p1"])),
                app_slug="jupyter",
                created_at=at(10),
                version=3,
                **values,
            )
        )
    return iid


async def _records(kit, iid) -> list:
    async with kit.sessions() as s:
        rows = await s.execute(
            select(app_usage_records).where(app_usage_records.c.instance_id == iid).order_by("occurred_at")
        )
        return list(rows)


async def test_each_window_is_recorded_once(metering) -> None:
    _client, kit, w = metering
    iid = await _instance(
        kit, w, status="decommissioned", launchable=True, running_since=at(10, 20), ended_at=at(12, 50)
    )

    async def closer() -> int:
        async with kit.sessions() as s, s.begin():
            return await record_app_hours(s, now=at(15))

    written = await asyncio.gather(closer(), closer(), closer())  # replicas racing: SKIP LOCKED + the key
    assert sum(written) == 3
    assert await closer() == 0  # a repeat writes nothing
    rows = await _records(kit, iid)
    assert [(r.unit, r.quantity, r.idempotency_key) for r in rows] == [
        ("app_hours", Decimal("0.666667"), key_for(at(10))),
        ("app_hours", Decimal("1.000000"), key_for(at(11))),
        ("app_hours", Decimal("0.833333"), key_for(at(12))),
    ]
    assert all(r.app_usage_record_id == app_usage_record_id(iid, r.idempotency_key) for r in rows)
    async with kit.sessions() as s:
        events = (
            await s.execute(
                text("SELECT count(*) FROM outbox WHERE event_type = 'app_usage.recorded' AND aggregate_id = :i"),
                {"i": str(iid)},
            )
        ).scalar_one()
    assert events == 3  # one event per record, none for the repeats


async def test_a_running_instance_is_recorded_window_by_window(metering) -> None:
    _client, kit, w = metering
    iid = await _instance(kit, w, status="running", launchable=True, running_since=at(10, 20))
    not_launchable = await _instance(kit, w, status="running", launchable=False, running_since=at(10, 20))

    async def closer(now: datetime) -> int:
        async with kit.sessions() as s, s.begin():
            return await record_app_hours(s, now=now)

    await closer(at(10, 40))  # the first window is still open: nothing yet
    assert await _records(kit, iid) == []
    await closer(at(11, 30))  # closed since 11:00, recorded from 11:20 on (an hour after the last mark)
    await closer(at(12, 30))
    rows = await _records(kit, iid)
    assert [r.quantity for r in rows] == [Decimal("0.666667"), Decimal("1.000000")]
    async with kit.sessions() as s, s.begin():  # it ends at 12:45: the last partial window follows
        await s.execute(instances.update().where(instances.c.instance_id == iid).values(ended_at=at(12, 45)))
    await closer(at(12, 46))
    assert [r.quantity for r in await _records(kit, iid)] == [
        Decimal("0.666667"),
        Decimal("1.000000"),
        Decimal("0.750000"),
    ]
    assert await _records(kit, not_launchable) == []  # controller-driven apps report their own usage
