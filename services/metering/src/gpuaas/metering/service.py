"""Metering use cases. Each runs in one transaction: meter state + usage records + outbox events
(+ audit record for API mutations) commit together or not at all."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import and_, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Actor, Event
from gpuaas.contracts.enums import AppUsageUnit, CapacityShape
from gpuaas.contracts.events import allocations as al
from gpuaas.contracts.events import app_runtime as ar
from gpuaas.contracts.events import usage as us
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound, Problem
from gpuaas.kit.logging import get_logger
from gpuaas.kit.outbox import add_events
from gpuaas.metering import domain
from gpuaas.metering.domain import Meter, MeterStatus, Window
from gpuaas.metering.models import app_usage_records, hosts, instances, meters, usage_records

SERVICE = "metering"
log = get_logger(__name__)
SYSTEM = Actor.system("metering")

# --------------------------------------------------------------------------------------- meters


def _meter_from_row(row: Any) -> Meter:
    return Meter(
        status=MeterStatus(row.status),
        gpu_count=row.gpu_count,
        opened_at=row.opened_at,
        billed_until=row.billed_until,
        changed_at=row.changed_at,
        closed_at=row.closed_at,
        close_reason=row.close_reason,
        suspended_at=row.suspended_at,
        suspend_reason=row.suspend_reason,
        resumed_at=row.resumed_at,
        late_stop_gpu_seconds=row.late_stop_gpu_seconds,
    )


def _meter_values(m: Meter) -> dict[str, Any]:
    return {
        "status": str(m.status),
        "gpu_count": m.gpu_count,
        "opened_at": m.opened_at,
        "billed_until": m.billed_until,
        "next_window_end": m.next_window_end,
        "changed_at": m.changed_at,
        "closed_at": m.closed_at,
        "close_reason": m.close_reason,
        "suspended_at": m.suspended_at,
        "suspend_reason": m.suspend_reason,
        "resumed_at": m.resumed_at,
        "late_stop_gpu_seconds": m.late_stop_gpu_seconds,
    }


def _state(ident: dict[str, Any], m: Meter, version: int) -> us.MeterState:
    return us.MeterState(
        allocation_id=ident["allocation_id"],
        tenant_id=ident["tenant_id"],
        project_id=ident["project_id"],
        host_id=ident["host_id"],
        shape=CapacityShape(ident["shape"]),
        gpu_model=ident["gpu_model"],
        gpu_count=m.gpu_count,
        status="closed" if m.status is MeterStatus.closed else "open",
        opened_at=m.opened_at,
        changed_at=m.changed_at,
        closed_at=m.closed_at,
        version=version,
        billed_until=m.billed_until,
        close_reason=m.close_reason,
        suspended_at=m.suspended_at,
        suspend_reason=m.suspend_reason,
        resumed_at=m.resumed_at,
    )


def _ident(row: Any) -> dict[str, Any]:
    return {k: getattr(row, k) for k in ("allocation_id", "tenant_id", "project_id", "host_id", "shape", "gpu_model")}


async def _record_windows(session: AsyncSession, ident: dict[str, Any], ws: list[Window]) -> list[Event]:
    """Insert the windows as usage records (a window already recorded is skipped) and return their events."""
    if not ws:
        return []
    rows = [
        {
            "usage_record_id": us.usage_record_id(ident["allocation_id"], w.start),
            **ident,
            "gpu_count": w.gpu_count,
            "window_start": w.start,
            "window_end": w.end,
            "gpu_seconds": w.gpu_seconds,
            "final": w.final,
        }
        for w in ws
    ]
    inserted = (
        await session.execute(
            pg_insert(usage_records).values(rows).on_conflict_do_nothing().returning(usage_records.c.usage_record_id)
        )
    ).scalars()
    fresh = set(inserted)
    events: list[Event] = []
    for r in rows:
        if r["usage_record_id"] not in fresh:
            continue
        data = us.UsageRecord(
            usage_record_id=r["usage_record_id"],
            allocation_id=ident["allocation_id"],
            tenant_id=ident["tenant_id"],
            project_id=ident["project_id"],
            host_id=ident["host_id"],
            shape=CapacityShape(ident["shape"]),
            gpu_model=ident["gpu_model"],
            gpu_count=r["gpu_count"],
            window_start=r["window_start"],
            window_end=r["window_end"],
            gpu_seconds=r["gpu_seconds"],
            final=r["final"],
        )
        events.append(us.UsageRecorded.build(data=data, source=SERVICE, actor=SYSTEM))
    return events


async def _save(
    session: AsyncSession,
    ident: dict[str, Any],
    m: Meter,
    *,
    version: int,
    allocation_version: int | None = None,
    insert_new: bool = False,
) -> None:
    values = {**_meter_values(m), "version": version, "updated_at": datetime.now(UTC)}
    if allocation_version is not None:
        values["allocation_version"] = allocation_version
    if insert_new:
        await session.execute(insert(meters).values(**ident, **values))
    else:
        await session.execute(update(meters).where(meters.c.allocation_id == ident["allocation_id"]).values(**values))


ALLOCATION_EVENTS = (
    al.AllocationActivated,
    al.AllocationRestarting,
    al.AllocationRestarted,
    al.AllocationRestartFailed,
    al.AllocationResizing,
    al.AllocationResized,
    al.AllocationResizeFailed,
    al.AllocationReleaseRequested,
    al.AllocationReleased,
    al.AllocationReleaseFailed,
    al.AllocationFailed,
)


async def apply_allocation(session: AsyncSession, event: Event) -> None:
    """Bring the allocation's meter in line with the allocation's full state (event-carried).

    Opens at `activated_at`; a new `gpu_count` changes it at `status_changed_at`; `billing_stopped_at`
    (set at the release request) closes it, whatever later happens to the release. Stale or duplicate
    states (version not newer) are ignored, so replays and redeliveries are no-ops.
    """
    a: al.AllocationState = event.data
    row = (
        await session.execute(select(meters).where(meters.c.allocation_id == a.allocation_id).with_for_update())
    ).first()
    events: list[Event] = []
    if row is None:
        if a.activated_at is None:
            return  # never active: never billed (e.g. allocation.failed in provisioning)
        ident = {
            "allocation_id": a.allocation_id,
            "tenant_id": a.tenant_id,
            "project_id": a.project_id,
            "host_id": a.host_id,
            "shape": str(a.shape),
            "gpu_model": a.gpu_model,
        }
        m = Meter.open(a.activated_at, a.gpu_count)
        version = 1
        events.append(us.MeterOpened.build(data=_state(ident, m, version), source=SERVICE, actor=SYSTEM))
        is_new = True
    else:
        if a.version <= row.allocation_version:
            return
        ident, m, version, is_new = _ident(row), _meter_from_row(row), row.version, False
    if m.status is not MeterStatus.closed:
        if a.gpu_count != m.gpu_count and not (is_new and a.billing_stopped_at is not None):
            ws = m.change(a.status_changed_at, a.gpu_count)
            events += await _record_windows(session, ident, ws)
            version += 1
            events.append(us.MeterChanged.build(data=_state(ident, m, version), source=SERVICE, actor=SYSTEM))
        if a.billing_stopped_at is not None:
            reason = "release_requested"
            if a.status == "release_failed":
                reason = f"release_requested (release then failed: {a.failure_reason or 'no reason given'})"
            ws = m.close(a.billing_stopped_at, reason)
            events += await _record_windows(session, ident, ws)
            version += 1
            events.append(us.MeterClosed.build(data=_state(ident, m, version), source=SERVICE, actor=SYSTEM))
        elif a.status in ("released", "failed"):
            # Defensive: a release without a release request (should not happen) still stops billing.
            ws = m.close(a.released_at or a.status_changed_at, f"{a.status} without a release request")
            events += await _record_windows(session, ident, ws)
            version += 1
            events.append(us.MeterClosed.build(data=_state(ident, m, version), source=SERVICE, actor=SYSTEM))
    elif a.status == "release_failed" and m.close_reason == "release_requested":
        # Already closed at the release request; say on the meter that the release then failed.
        m.close_reason = f"release_requested (release then failed: {a.failure_reason or 'no reason given'})"
    await _save(session, ident, m, version=version, allocation_version=a.version, insert_new=is_new)
    await add_events(session, events)


async def apply_host(session: AsyncSession, event: Event) -> None:
    """Keep the host projection; a host that heartbeats again resumes its suspended meters."""
    h: al.HostState = event.data
    row = (await session.execute(select(hosts).where(hosts.c.host_id == h.host_id).with_for_update())).first()
    if row is not None and h.version <= row.version:
        return
    lost = event.type == al.HostHeartbeatLost.event_type() or h.status == al.HostStatus.unreachable
    lost_since = (h.last_heartbeat_at or event.time) if lost else None
    values = {
        "name": h.name,
        "status": str(h.status),
        "last_heartbeat_at": h.last_heartbeat_at,
        "lost_since": lost_since,
        "version": h.version,
    }
    if row is None:
        await session.execute(insert(hosts).values(host_id=h.host_id, **values))
    else:
        await session.execute(update(hosts).where(hosts.c.host_id == h.host_id).values(**values))
    if lost or h.status == al.HostStatus.decommissioned:
        return
    # Back: suspended meters count again from the recovery heartbeat.
    resumed_at = h.last_heartbeat_at or event.time
    suspended = (
        await session.execute(
            select(meters).where(meters.c.host_id == h.host_id, meters.c.status == "suspended").with_for_update()
        )
    ).all()
    events: list[Event] = []
    for r in suspended:
        m = _meter_from_row(r)
        m.resume(resumed_at)
        await _save(session, _ident(r), m, version=r.version + 1)
        events.append(us.MeterResumed.build(data=_state(_ident(r), m, r.version + 1), source=SERVICE, actor=SYSTEM))
    await add_events(session, events)


async def close_due_windows(
    session: AsyncSession, *, now: datetime, settle: timedelta, grace: timedelta, limit: int = 200
) -> tuple[int, int]:
    """One pass of the window closer: claim due meters (FOR UPDATE SKIP LOCKED, so several replicas
    share the work without double-recording), record their full hours, suspend those whose host has
    been silent beyond the grace. Returns (meters claimed, usage records written)."""
    record_until = now - settle
    lost_before = now - grace
    rows = (
        await session.execute(
            select(meters, hosts.c.lost_since, hosts.c.name.label("host_name"))
            .select_from(meters.outerjoin(hosts, hosts.c.host_id == meters.c.host_id))
            .where(
                meters.c.status == "open",
                or_(
                    meters.c.next_window_end <= record_until,
                    and_(hosts.c.lost_since.is_not(None), hosts.c.lost_since <= lost_before),
                ),
            )
            .order_by(meters.c.next_window_end)
            .limit(limit)
            .with_for_update(of=meters, skip_locked=True)
        )
    ).all()
    written = 0
    events: list[Event] = []
    for r in rows:
        ident, m = _ident(r), _meter_from_row(r)
        version = r.version
        if r.lost_since is not None and r.lost_since <= lost_before:
            at = domain.suspend_point(r.lost_since, grace)
            ws = m.suspend(at, domain.suspend_reason(r.host_name, r.lost_since, grace))
            new = await _record_windows(session, ident, ws)
            version += 1
            new.append(us.MeterSuspended.build(data=_state(ident, m, version), source=SERVICE, actor=SYSTEM))
        else:
            ws = m.record_full_windows(record_until)
            new = await _record_windows(session, ident, ws)
        written += sum(1 for e in new if isinstance(e, us.UsageRecorded))
        events += new
        await _save(session, ident, m, version=version)
    await add_events(session, events)
    return len(rows), written


# ------------------------------------------------------------------------------------- instances

_ENDED = {"stopped", "decommissioned", "failed"}


async def apply_instance(session: AsyncSession, event: Event) -> None:
    i: ar.InstanceState = event.data
    row = (await session.execute(select(instances).where(instances.c.instance_id == i.instance_id))).first()
    if row is not None and i.version <= row.version:
        return
    ended_at = i.status_changed_at if str(i.status) in _ENDED else None
    values = {
        "tenant_id": i.tenant_id,
        "project_id": i.project_id,
        "app_slug": i.app_slug,
        "status": str(i.status),
        "ended_at": ended_at,
        "version": i.version,
    }
    if row is None:
        created = i.status_changed_at if i.status == "created" else min(i.status_changed_at, event.time)
        await session.execute(insert(instances).values(instance_id=i.instance_id, created_at=created, **values))
    else:
        await session.execute(update(instances).where(instances.c.instance_id == i.instance_id).values(**values))


# ------------------------------------------------------------------------------------- app usage


def _app_usage_out(row: Any, duplicate: bool) -> dict[str, Any]:
    return {
        "app_usage_record_id": row.app_usage_record_id,
        "instance_id": row.instance_id,
        "tenant_id": row.tenant_id,
        "project_id": row.project_id,
        "app_slug": row.app_slug,
        "member_id": row.member_id,
        "unit": row.unit,
        "quantity": row.quantity,
        "idempotency_key": row.idempotency_key,
        "occurred_at": row.occurred_at,
        "reported_by": row.reported_by,
        "recorded_at": row.recorded_at,
        "duplicate": duplicate,
    }


async def record_app_usage(
    session: AsyncSession,
    principal: Principal,
    *,
    instance_id: uuid.UUID,
    unit: AppUsageUnit,
    quantity: Decimal,
    idempotency_key: str,
    occurred_at: datetime,
    member_id: uuid.UUID | None,
    now: datetime,
    late: timedelta,
    skew: timedelta,
) -> dict[str, Any]:
    """Accept one app usage event once. A re-post with the same key answers the stored record
    (`duplicate`); the same key with a different body is a conflict; an occurrence time outside the
    instance's accepted window is refused (`usage_out_of_window`)."""
    inst = (await session.execute(select(instances).where(instances.c.instance_id == instance_id))).first()
    if inst is None:
        raise NotFound("no such app instance (or not known to metering yet)", code="instance_not_found")
    if principal.is_service_account:
        await iam.authorize(session, principal, "metering.usage.write", project_id=inst.project_id)
    else:
        await iam.authorize(session, principal, "metering.usage.backfill", project_id=inst.project_id)
    record_id = us.app_usage_record_id(instance_id, idempotency_key)
    existing = (
        await session.execute(
            select(app_usage_records).where(app_usage_records.c.app_usage_record_id == record_id).with_for_update()
        )
    ).first()
    if existing is not None:
        return _same_or_conflict(existing, unit, quantity, occurred_at, member_id)
    window = domain.app_usage_window(now, late, skew, inst.created_at, inst.ended_at)
    if not (window.accepted_from <= occurred_at <= window.accepted_until):
        raise Problem(
            f"occurred_at {occurred_at.isoformat()} is outside the accepted window "
            f"[{window.accepted_from.isoformat()}, {window.accepted_until.isoformat()}] of this instance",
            code="usage_out_of_window",
            status=422,
            title="Usage outside the accepted window",
            accepted_from=window.accepted_from.isoformat(),
            accepted_until=window.accepted_until.isoformat(),
        )
    values = {
        "app_usage_record_id": record_id,
        "instance_id": instance_id,
        "tenant_id": inst.tenant_id,
        "project_id": inst.project_id,
        "app_slug": inst.app_slug,
        "member_id": member_id,
        "unit": str(unit),
        "quantity": quantity,
        "idempotency_key": idempotency_key,
        "occurred_at": occurred_at,
        "reported_by": str(principal.subject),
    }
    inserted = (
        await session.execute(
            pg_insert(app_usage_records).values(values).on_conflict_do_nothing().returning(app_usage_records)
        )
    ).first()
    if inserted is None:  # a concurrent post of the same key won the race
        existing = (
            await session.execute(select(app_usage_records).where(app_usage_records.c.app_usage_record_id == record_id))
        ).one()
        return _same_or_conflict(existing, unit, quantity, occurred_at, member_id)
    data = us.AppUsageRecord(
        app_usage_record_id=record_id,
        instance_id=instance_id,
        tenant_id=inst.tenant_id,
        project_id=inst.project_id,
        app_slug=inst.app_slug,
        member_id=member_id,
        unit=unit,
        quantity=quantity,
        idempotency_key=idempotency_key,
        occurred_at=occurred_at,
        reported_by=str(principal.subject),
    )
    await add_events(session, [us.AppUsageRecorded.build(data=data, source=SERVICE, actor=principal.actor)])
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="metering.app_usage.record",
        resource_type="app_usage_record",
        resource_id=record_id,
        tenant_id=inst.tenant_id,
        project_id=inst.project_id,
        after=data.model_dump(mode="json"),
    )
    return _app_usage_out(inserted, duplicate=False)


def _same_or_conflict(
    row: Any, unit: AppUsageUnit, quantity: Decimal, occurred_at: datetime, member_id: uuid.UUID | None
) -> dict[str, Any]:
    same = (
        row.unit == str(unit)
        and Decimal(row.quantity) == quantity
        and row.occurred_at == occurred_at
        and row.member_id == member_id
    )
    if not same:
        raise Conflict(
            "this idempotency key was already used for a different usage event",
            code="idempotency_key_reused",
        )
    return _app_usage_out(row, duplicate=True)
