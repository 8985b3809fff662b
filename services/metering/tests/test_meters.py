"""Meters from allocation events (on the real broker, or applied in-process), the window closer, and the
heartbeat rule. Every story is placed in whole past hours and the closer is moved by the test to chosen
instants (see conftest), so no assertion depends on where in the hour the test happens to run."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import func, select, text

from gpuaas.contracts.enums import AllocationStatus
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.kit.testing import wait_for
from gpuaas.metering import service
from gpuaas.metering.domain import hour_floor
from gpuaas.metering.models import hosts, meters, usage_records

pytestmark = pytest.mark.integration
MICRO = Decimal("0.000001")


def now() -> datetime:
    return datetime.now(UTC)


def last_hour() -> datetime:
    """The start of the last full hour: a story from there on lies wholly in the past."""
    return hour_floor(now()) - timedelta(hours=1)


async def meter(kit, allocation_id):
    async with kit.sessions() as s:
        return (await s.execute(select(meters).where(meters.c.allocation_id == allocation_id))).first()


async def host_lost_since(kit, host_id):
    async with kit.sessions() as s:
        return (await s.execute(select(hosts.c.lost_since).where(hosts.c.host_id == host_id))).scalar_one_or_none()


async def usage(kit, allocation_id) -> tuple[int, Decimal]:
    async with kit.sessions() as s:
        row = (
            await s.execute(
                select(func.count(), func.coalesce(func.sum(usage_records.c.gpu_seconds), 0)).where(
                    usage_records.c.allocation_id == allocation_id
                )
            )
        ).one()
    return row[0], Decimal(row[1])


async def outbox_count(kit, event_type: str, subject: uuid.UUID) -> int:
    async with kit.sessions() as s:
        return (
            await s.execute(
                text("SELECT count(*) FROM outbox WHERE event_type = :t AND aggregate_id = :a"),
                {"t": event_type, "a": str(subject)},
            )
        ).scalar_one()


def seconds(gpus: int, start: datetime, end: datetime) -> Decimal:
    return (Decimal(gpus) * Decimal(str((end - start).total_seconds()))).quantize(MICRO)


async def test_release_failed_allocation_stops_accruing_at_the_release_request(h, metering, infra, auth) -> None:
    client, kit, w = metering
    hour = last_hour()
    activated = hour - timedelta(hours=2) + timedelta(minutes=15)
    e1, a = h.new_allocation(w["t1"], w["p1"], activated, gpus=2)
    await h.publish(infra.kafka_bootstrap, [e1])
    await wait_for(lambda: meter(kit, a.allocation_id), 30, "meter opened")
    # The closer, as of `hour`, records the two hours that have ended: [activated, hour - 1h), [hour - 1h, hour).
    assert await h.close_windows(kit, at=hour) is False
    assert (await usage(kit, a.allocation_id))[0] == 2
    stop = hour + timedelta(minutes=20)
    e2, a = h.allocation(
        allocation_events.AllocationReleaseRequested,
        a,
        status=AllocationStatus.releasing,
        status_changed_at=stop,
        release_requested_at=stop,
        billing_stopped_at=stop,
        release_attempts=1,
    )
    e3, a = h.allocation(
        allocation_events.AllocationReleaseFailed,
        a,
        status=AllocationStatus.release_failed,
        status_changed_at=stop + timedelta(seconds=20),
        failure_reason="agent unreachable",
    )
    await h.publish(infra.kafka_bootstrap, [e2, e3])
    await wait_for(lambda: _reason_has(kit, a.allocation_id, "release then failed"), 30, "release failure noted")
    m = await meter(kit, a.allocation_id)
    assert m.status == "closed" and m.closed_at == stop and m.close_reason.startswith("release_requested")
    assert "release then failed: agent unreachable" in m.close_reason
    n, total = await usage(kit, a.allocation_id)
    assert total == seconds(2, activated, stop) and n == 3
    # Time passes, the closer keeps running: nothing more accrues on the failed release.
    await h.close_windows(kit, at=hour + timedelta(hours=5))
    assert await usage(kit, a.allocation_id) == (n, total)
    assert await outbox_count(kit, "usage.recorded", a.allocation_id) == 3
    assert await outbox_count(kit, "meter.closed", a.allocation_id) == 1
    # The meter answers when billing stopped and why.
    r = await client.get(f"/meters/{a.allocation_id}", headers=auth(w["viewer"]))
    assert r.status_code == 200 and r.json()["status"] == "closed"
    assert datetime.fromisoformat(r.json()["closed_at"]) == stop


async def test_replayed_and_redelivered_lifecycle_events_never_add_usage(h, metering, infra) -> None:
    _client, kit, w = metering
    activated = now() - timedelta(minutes=90)
    e1, a = h.new_allocation(w["t1"], w["p1"], activated, gpus=1)
    stop = now() - timedelta(minutes=1)
    e2, _a2 = h.allocation(
        allocation_events.AllocationReleaseRequested,
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
    stale, _ = h.allocation(allocation_events.AllocationActivated, a, version=1)
    await h.publish(infra.kafka_bootstrap, [*again, stale, e1, e2])
    marker, _ = h.new_allocation(w["t1"], w["p1"], now(), gpus=1)
    await h.publish(infra.kafka_bootstrap, [marker])  # once this is applied, everything before it is too
    await wait_for(lambda: meter(kit, marker.data.allocation_id), 30, "marker applied")
    assert await usage(kit, a.allocation_id) == before
    assert before[1] == seconds(1, activated, stop)


async def test_resize_splits_usage_at_the_change(h, metering, infra, auth) -> None:
    client, kit, w = metering
    activated = last_hour() + timedelta(minutes=40)  # the story crosses an hour boundary at +20 min
    e1, a = h.new_allocation(w["t1"], w["p1"], activated, gpus=2)
    changed = activated + timedelta(minutes=10)
    e2, a = h.allocation(allocation_events.AllocationResized, a, gpu_count=4, status_changed_at=changed)
    stop = activated + timedelta(minutes=30)
    e3, a = h.allocation(
        allocation_events.AllocationReleaseRequested,
        a,
        status=AllocationStatus.releasing,
        status_changed_at=stop,
        billing_stopped_at=stop,
    )
    await h.publish(infra.kafka_bootstrap, [e1, e2, e3])
    await wait_for(lambda: _closed(kit, a.allocation_id), 30, "meter closed")
    _, total = await usage(kit, a.allocation_id)
    assert total == Decimal(2 * 600 + 4 * 1200)
    r = await client.get(f"/meters/{a.allocation_id}/usage", headers=auth(w["viewer"]))
    assert r.status_code == 200
    windows = [(u["gpu_count"], u["gpu_seconds"], u["final"]) for u in r.json()]
    # [activated, changed) at 2 GPUs; [changed, boundary) and [boundary, stop) at 4, the last one final.
    assert windows == [(2, "1200.000000", False), (4, "2400.000000", False), (4, "2400.000000", True)]


async def test_heartbeat_lost_suspends_billing_after_grace_and_recovery_resumes(h, metering, infra, auth) -> None:
    client, kit, w = metering
    t = last_hour() - timedelta(hours=2)
    host_id = uuid.uuid4()
    activated, last_beat = t + timedelta(minutes=5), t + timedelta(minutes=25)
    ready = allocation_events.HostStatus.ready
    host = allocation_events.HostState(
        host_id=host_id, name="gpu-07", status=ready, last_heartbeat_at=activated, version=1
    )
    e1, a = h.new_allocation(w["t1"], w["p1"], activated, gpus=1, host=host_id)
    lost = allocation_events.HostHeartbeatLost.build(
        data=host.model_copy(
            update={"status": allocation_events.HostStatus.unreachable, "last_heartbeat_at": last_beat, "version": 2}
        ),
        source="allocations",
    )
    enrolled = allocation_events.HostEnrolled.build(data=host, source="allocations")
    await h.publish(infra.kafka_bootstrap, [enrolled, e1, lost])
    await wait_for(lambda: meter(kit, a.allocation_id), 30, "meter opened")
    await wait_for(lambda: _is(host_lost_since(kit, host_id), last_beat), 30, "host known lost")
    # grace is 600 s: billing goes on until the last heartbeat + 10 min, then stops with the reason on the meter.
    suspend_at = last_beat + timedelta(minutes=10)
    await h.close_windows(kit, at=suspend_at - timedelta(seconds=1))
    assert await _status(kit, a.allocation_id, "open")
    await h.close_windows(kit, at=suspend_at)
    m = await meter(kit, a.allocation_id)
    assert m.status == "suspended" and m.suspended_at == suspend_at
    assert m.suspend_reason.startswith("host_heartbeat_lost: host gpu-07")
    r = await client.get(f"/meters/{a.allocation_id}", headers=auth(w["viewer"]))
    assert r.json()["status"] == "suspended" and "heartbeat" in r.json()["suspend_reason"]
    assert (await usage(kit, a.allocation_id))[1] == Decimal(30 * 60)
    # Hours pass while the host is away: a suspended meter records nothing.
    await h.close_windows(kit, at=t + timedelta(hours=2))
    assert (await usage(kit, a.allocation_id))[1] == Decimal(30 * 60)
    # The host heartbeats again: billing resumes from the recovery heartbeat, the gap is free.
    back_at = t + timedelta(hours=2, minutes=10)
    back = allocation_events.HostUpdated.build(
        data=host.model_copy(update={"last_heartbeat_at": back_at, "version": 3}), source="allocations"
    )
    await h.publish(infra.kafka_bootstrap, [back])
    await wait_for(lambda: _status(kit, a.allocation_id, "open"), 30, "meter resumed")
    stop = back_at + timedelta(seconds=90)
    e2, a = h.allocation(
        allocation_events.AllocationReleaseRequested,
        a,
        status=AllocationStatus.releasing,
        status_changed_at=stop,
        billing_stopped_at=stop,
    )
    await h.publish(infra.kafka_bootstrap, [e2])
    await wait_for(lambda: _closed(kit, a.allocation_id), 30, "meter closed")
    assert (await usage(kit, a.allocation_id))[1] == Decimal(30 * 60 + 90)
    assert await outbox_count(kit, "meter.suspended", a.allocation_id) == 1
    assert await outbox_count(kit, "meter.resumed", a.allocation_id) == 1


async def test_an_allocation_that_fails_before_it_is_active_is_never_metered(h, metering, auth) -> None:
    client, kit, w = metering
    requested = last_hour()
    _, a = h.new_allocation(w["t1"], w["p1"], requested, gpus=4)
    provisioning = a.model_copy(
        update={"status": AllocationStatus.provisioning, "activated_at": None, "status_changed_at": requested}
    )
    failed, _ = h.allocation(
        allocation_events.AllocationFailed,
        provisioning,
        status=AllocationStatus.failed,
        status_changed_at=requested + timedelta(minutes=3),
        failure_reason="image pull failed",
    )
    await h.apply(kit, failed)
    await h.close_windows(kit, at=requested + timedelta(hours=3))
    assert await meter(kit, a.allocation_id) is None
    assert await usage(kit, a.allocation_id) == (0, Decimal(0))
    assert await outbox_count(kit, "meter.opened", a.allocation_id) == 0
    r = await client.get(f"/meters/{a.allocation_id}", headers=auth(w["viewer"]))
    assert r.status_code == 404 and r.json()["code"] == "meter_not_found"


async def test_an_allocation_that_fails_while_active_is_metered_up_to_the_failure(h, metering, auth) -> None:
    client, kit, w = metering
    activated = last_hour() - timedelta(hours=1) + timedelta(minutes=10)
    opened, a = h.new_allocation(w["t1"], w["p1"], activated, gpus=2)
    await h.apply(kit, opened)
    await h.close_windows(kit, at=activated + timedelta(minutes=50))  # the first hour [activated, boundary)
    failed_at = activated + timedelta(minutes=80)
    failed, a = h.allocation(
        allocation_events.AllocationFailed,
        a,
        status=AllocationStatus.failed,
        status_changed_at=failed_at,
        failure_reason="host lost its GPUs",
    )
    await h.apply(kit, failed)
    m = await meter(kit, a.allocation_id)
    assert m.status == "closed" and m.closed_at == failed_at
    assert m.close_reason == "failed without a release request"
    n, total = await usage(kit, a.allocation_id)
    assert (n, total) == (2, seconds(2, activated, failed_at))
    await h.close_windows(kit, at=failed_at + timedelta(hours=4))
    assert await usage(kit, a.allocation_id) == (n, total)
    r = await client.get(f"/meters/{a.allocation_id}/usage", headers=auth(w["viewer"]))
    assert [u["final"] for u in r.json()] == [False, True]
    assert await outbox_count(kit, "meter.closed", a.allocation_id) == 1


async def test_closer_replicas_share_due_meters_without_double_recording(h, metering) -> None:
    _client, kit, w = metering
    # Meters 3 h old, created through the handlers in-process (no broker needed for this property); the
    # app's own closer is idle in this fixture, so only the two replicas below compete.
    opened = [h.new_allocation(w["t1"], w["p1"], now() - timedelta(hours=3), gpus=1) for _ in range(30)]
    await h.apply(kit, *(e for e, _ in opened))
    ids = [a.allocation_id for _, a in opened]

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


async def test_the_closer_claims_the_next_batch_at_once_while_batches_are_full(h, metering) -> None:
    _client, kit, w = metering
    hour = last_hour()
    opened = [h.new_allocation(w["t1"], w["p1"], hour - timedelta(minutes=30), gpus=1) for _ in range(12)]
    await h.apply(kit, *(e for e, _ in opened))
    # Batches of 5 (conftest): full, full, then the last 2 and nothing left; True means "go on at once".
    assert [await h.close_windows(kit, at=hour) for _ in range(4)] == [True, True, False, False]
    assert [(await usage(kit, a.allocation_id))[0] for _, a in opened] == [1] * 12


async def test_the_background_closer_records_every_ended_hour(h, metering_live_closer) -> None:
    _client, kit, w = metering_live_closer
    activated = hour_floor(now()) - timedelta(hours=3) + timedelta(minutes=15)
    opened, a = h.new_allocation(w["t1"], w["p1"], activated, gpus=3)
    await h.apply(kit, opened)
    # Recorded up to the last hour boundary the closer has passed (at least the one before this test began).
    boundary = hour_floor(activated) + timedelta(hours=3)
    await wait_for(lambda: _billed_at_least(kit, a.allocation_id, boundary), 30, "ended hours recorded")
    m = await meter(kit, a.allocation_id)
    n, total = await usage(kit, a.allocation_id)
    assert m.status == "open" and m.billed_until == hour_floor(m.billed_until)
    assert total == seconds(3, activated, m.billed_until)
    assert n == round((m.billed_until - hour_floor(activated)) / timedelta(hours=1))


async def _is(value_coro, expected) -> bool:
    return (await value_coro) == expected


async def _billed_at_least(kit, allocation_id, until: datetime) -> bool:
    m = await meter(kit, allocation_id)
    return m is not None and m.billed_until >= until


async def _reason_has(kit, allocation_id, text_: str) -> bool:
    m = await meter(kit, allocation_id)
    return m is not None and text_ in (m.close_reason or "")


async def _closed(kit, allocation_id) -> bool:
    return await _status(kit, allocation_id, "closed")


async def _status(kit, allocation_id, status: str) -> bool:
    m = await meter(kit, allocation_id)
    return m is not None and m.status == status
