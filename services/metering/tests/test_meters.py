"""Meters from allocation events on the real broker, the window closer, and the heartbeat rule."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import func, select, text

from gpuaas.contracts.enums import AllocationStatus
from gpuaas.contracts.events import allocations as al
from gpuaas.kit.testing import wait_for
from gpuaas.metering import service
from gpuaas.metering.domain import hour_floor
from gpuaas.metering.models import meters, usage_records

pytestmark = pytest.mark.integration


def now() -> datetime:
    return datetime.now(UTC)


async def meter(kit, allocation_id):  # type: ignore[no-untyped-def]
    async with kit.sessions() as s:
        return (await s.execute(select(meters).where(meters.c.allocation_id == allocation_id))).first()


async def usage(kit, allocation_id) -> tuple[int, Decimal]:  # type: ignore[no-untyped-def]
    async with kit.sessions() as s:
        row = (
            await s.execute(
                select(func.count(), func.coalesce(func.sum(usage_records.c.gpu_seconds), 0)).where(
                    usage_records.c.allocation_id == allocation_id
                )
            )
        ).one()
    return row[0], Decimal(row[1])


async def outbox_count(kit, event_type: str, subject: uuid.UUID) -> int:  # type: ignore[no-untyped-def]
    async with kit.sessions() as s:
        return (
            await s.execute(
                text("SELECT count(*) FROM outbox WHERE event_type = :t AND aggregate_id = :a"),
                {"t": event_type, "a": str(subject)},
            )
        ).scalar_one()


async def test_release_failed_allocation_stops_accruing_at_the_release_request(h, metering, infra, auth) -> None:  # type: ignore[no-untyped-def]
    client, kit, w = metering
    activated = hour_floor(now()) - timedelta(hours=2) + timedelta(minutes=15)
    e1, a = h.new_allocation(w["t1"], w["p1"], activated, gpus=2)
    await h.publish(infra.kafka_bootstrap, [e1])
    # The closer records the two full hours that have passed (settle 0 in this test).
    await wait_for(lambda: _count_is(kit, a.allocation_id, 2), 30, "two full windows")
    stop = now() - timedelta(seconds=30)
    e2, a = h.allocation(
        al.AllocationReleaseRequested,
        a,
        status=AllocationStatus.releasing,
        status_changed_at=stop,
        release_requested_at=stop,
        billing_stopped_at=stop,
        release_attempts=1,
    )
    e3, a = h.allocation(
        al.AllocationReleaseFailed,
        a,
        status=AllocationStatus.release_failed,
        status_changed_at=stop + timedelta(seconds=20),
        failure_reason="agent unreachable",
    )
    await h.publish(infra.kafka_bootstrap, [e2, e3])
    await wait_for(lambda: _closed(kit, a.allocation_id), 30, "meter closed")
    m = await meter(kit, a.allocation_id)
    assert m.closed_at == stop and m.close_reason.startswith("release_requested")
    assert "release then failed: agent unreachable" in m.close_reason
    n, seconds = await usage(kit, a.allocation_id)
    expected = Decimal(2) * Decimal(str((stop - activated).total_seconds()))
    assert seconds == expected.quantize(Decimal("0.000001")) and n == 3
    # Time passes, the closer keeps running: nothing more accrues on the failed release.
    async with kit.sessions() as s, s.begin():
        await service.close_due_windows(
            s, now=now() + timedelta(hours=5), settle=timedelta(0), grace=timedelta(minutes=10)
        )
    assert await usage(kit, a.allocation_id) == (n, seconds)
    assert await outbox_count(kit, "usage.recorded", a.allocation_id) == 3
    assert await outbox_count(kit, "meter.closed", a.allocation_id) == 1
    # The meter answers when billing stopped and why.
    r = await client.get(f"/meters/{a.allocation_id}", headers=auth(w["viewer"]))
    assert r.status_code == 200 and r.json()["status"] == "closed"
    assert r.json()["closed_at"].startswith(stop.isoformat()[:19])


async def test_replayed_and_redelivered_lifecycle_events_never_add_usage(h, metering, infra) -> None:  # type: ignore[no-untyped-def]
    _client, kit, w = metering
    activated = now() - timedelta(minutes=90)
    e1, a = h.new_allocation(w["t1"], w["p1"], activated, gpus=1)
    stop = now() - timedelta(minutes=1)
    e2, _a2 = h.allocation(
        al.AllocationReleaseRequested,
        a,
        status=AllocationStatus.releasing,
        status_changed_at=stop,
        billing_stopped_at=stop,
    )
    await h.publish(infra.kafka_bootstrap, [e1, e2])
    await wait_for(lambda: _closed(kit, a.allocation_id), 30, "meter closed")
    before = await usage(kit, a.allocation_id)
    # Same states under new event ids (a producer retry / a topic rebuilt from snapshots), and stale ones.
    again = [type(e).build(data=e.data, source="allocations") for e in (e1, e2)]
    stale, _ = h.allocation(al.AllocationActivated, a, version=1)
    await h.publish(infra.kafka_bootstrap, [*again, stale, e1, e2])
    marker, _ = h.new_allocation(w["t1"], w["p1"], now(), gpus=1)
    await h.publish(infra.kafka_bootstrap, [marker])  # once this is applied, everything before it is too
    await wait_for(lambda: meter(kit, marker.data.allocation_id), 30, "marker applied")
    assert await usage(kit, a.allocation_id) == before
    assert before[1] == Decimal(str((stop - activated).total_seconds())).quantize(Decimal("0.000001"))


async def test_resize_splits_usage_at_the_change(h, metering, infra, auth) -> None:  # type: ignore[no-untyped-def]
    client, kit, w = metering
    # The whole story lies within the window closer's settle horizon (120 s), so no hourly window can be
    # closed between the activation and the resize being applied, whatever the wall clock says.
    activated = now() - timedelta(seconds=100)
    e1, a = h.new_allocation(w["t1"], w["p1"], activated, gpus=2)
    changed = activated + timedelta(seconds=40)
    e2, a = h.allocation(al.AllocationResized, a, gpu_count=4, status_changed_at=changed)
    stop = activated + timedelta(seconds=80)
    e3, a = h.allocation(
        al.AllocationReleaseRequested,
        a,
        status=AllocationStatus.releasing,
        status_changed_at=stop,
        billing_stopped_at=stop,
    )
    await h.publish(infra.kafka_bootstrap, [e1, e2, e3])
    await wait_for(lambda: _closed(kit, a.allocation_id), 30, "meter closed")
    _, seconds = await usage(kit, a.allocation_id)
    assert seconds == Decimal(2 * 40 + 4 * 40)
    r = await client.get(f"/meters/{a.allocation_id}/usage", headers=auth(w["viewer"]))
    assert r.status_code == 200
    counts = [u["gpu_count"] for u in r.json()]
    assert counts[0] == 2 and counts[-1] == 4 and r.json()[-1]["final"] is True


async def test_heartbeat_lost_suspends_billing_after_grace_and_recovery_resumes(h, metering, infra, auth) -> None:  # type: ignore[no-untyped-def]
    client, kit, w = metering
    host_id = uuid.uuid4()
    t = now()
    host = al.HostState(host_id=host_id, name="gpu-07", status=al.HostStatus.ready, last_heartbeat_at=t, version=1)
    # Billing stops at the last heartbeat + grace. Put that moment inside the current hourly window (still
    # open), so the meter's hourly closer cannot have recorded a window past it, whatever the wall clock says.
    hour = t.replace(minute=0, second=0, microsecond=0)
    suspend_at = hour + (t - hour) / 2
    last_beat = suspend_at - timedelta(minutes=10)
    activated = last_beat - timedelta(minutes=20)
    e1, a = h.new_allocation(w["t1"], w["p1"], activated, gpus=1, host=host_id)
    lost = al.HostHeartbeatLost.build(
        data=host.model_copy(
            update={"status": al.HostStatus.unreachable, "last_heartbeat_at": last_beat, "version": 2}
        ),
        source="allocations",
    )
    await h.publish(infra.kafka_bootstrap, [al.HostEnrolled.build(data=host, source="allocations"), e1, lost])
    # grace is 600 s: billing stops at last heartbeat + 10 min, with the reason on the meter.
    await wait_for(lambda: _status(kit, a.allocation_id, "suspended"), 30, "meter suspended")
    m = await meter(kit, a.allocation_id)
    assert m.suspended_at == last_beat + timedelta(minutes=10)
    assert m.suspend_reason.startswith("host_heartbeat_lost: host gpu-07")
    r = await client.get(f"/meters/{a.allocation_id}", headers=auth(w["viewer"]))
    assert r.json()["status"] == "suspended" and "heartbeat" in r.json()["suspend_reason"]
    _, suspended_seconds = await usage(kit, a.allocation_id)
    assert suspended_seconds == Decimal(30 * 60)
    # The host heartbeats again: billing resumes from the recovery heartbeat, the gap is free.
    back_at = now()
    back = al.HostUpdated.build(
        data=host.model_copy(update={"last_heartbeat_at": back_at, "version": 3}), source="allocations"
    )
    await h.publish(infra.kafka_bootstrap, [back])
    await wait_for(lambda: _status(kit, a.allocation_id, "open"), 30, "meter resumed")
    stop = back_at + timedelta(seconds=90)
    e2, a = h.allocation(
        al.AllocationReleaseRequested,
        a,
        status=AllocationStatus.releasing,
        status_changed_at=stop,
        billing_stopped_at=stop,
    )
    await h.publish(infra.kafka_bootstrap, [e2])
    await wait_for(lambda: _closed(kit, a.allocation_id), 30, "meter closed")
    _, total = await usage(kit, a.allocation_id)
    assert total == Decimal(30 * 60 + 90)
    assert await outbox_count(kit, "meter.suspended", a.allocation_id) == 1
    assert await outbox_count(kit, "meter.resumed", a.allocation_id) == 1


async def test_closer_replicas_share_due_meters_without_double_recording(h, metering, infra) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    _client, kit, w = metering
    # Meters 3 h old, created directly through the handler (no broker needed for this property).
    ids = []
    async with kit.sessions() as s, s.begin():
        for _ in range(30):
            e, a = h.new_allocation(w["t1"], w["p1"], now() - timedelta(hours=3), gpus=1)
            await service.apply_allocation(s, e)
            ids.append(a.allocation_id)
    kit.stopping.set()  # stop the app's own closer so only the two below compete

    async def replica() -> int:
        total = 0
        for _ in range(5):
            async with kit.sessions() as s, s.begin():
                _, written = await service.close_due_windows(
                    s, now=now(), settle=timedelta(0), grace=timedelta(minutes=10), limit=7
                )
                total += written
        return total

    written = sum(await asyncio.gather(replica(), replica()))
    async with kit.sessions() as s:
        rows = (await s.execute(select(func.count()).where(usage_records.c.allocation_id.in_(ids)))).scalar_one()
        events = (
            await s.execute(
                text("SELECT count(*) FROM outbox WHERE event_type = 'usage.recorded' AND aggregate_id = ANY(:ids)"),
                {"ids": [str(i) for i in ids]},
            )
        ).scalar_one()
    assert rows == events == written


async def _count_is(kit, allocation_id, n: int) -> bool:  # type: ignore[no-untyped-def]
    return (await usage(kit, allocation_id))[0] == n


async def _closed(kit, allocation_id) -> bool:  # type: ignore[no-untyped-def]
    return await _status(kit, allocation_id, "closed")


async def _status(kit, allocation_id, status: str) -> bool:  # type: ignore[no-untyped-def]
    m = await meter(kit, allocation_id)
    return m is not None and m.status == status
