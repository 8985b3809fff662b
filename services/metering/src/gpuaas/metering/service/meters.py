"""Meters: allocation lifecycle events open, change and close them; the window closer records their full
hours and applies the heartbeat rule; a host that comes back resumes them. Each use case runs in one
transaction: meter state + usage records + outbox events commit together or not at all."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Actor, Event
from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.contracts.events import usage as usage_events
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import NotFound
from gpuaas.kit.outbox import add_events
from gpuaas.metering import SERVICE, domain
from gpuaas.metering.domain import Meter, MeterStatus, Window
from gpuaas.metering.metrics import usage_emitted
from gpuaas.metering.models import hosts, members, meters, usage_records
from gpuaas.metering.service.access import readable
from gpuaas.metering.service.views import MeterOut, UsageRecordOut

SYSTEM = Actor.system(SERVICE)


@dataclass(frozen=True)
class MeterIdent:
    """What a meter (and each of its usage records) says about the allocation; fixed at opening."""

    allocation_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    host_id: uuid.UUID | None
    shape: str
    gpu_model: str

    @classmethod
    def of(cls, row: Any) -> MeterIdent:
        return cls(**{f: getattr(row, f) for f in cls.__dataclass_fields__})


def _meter_of(row: Any) -> Meter:
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


@dataclass
class MeterUpdate:
    """One meter's change in a transaction: the events it produces, in order, and its version."""

    ident: MeterIdent
    meter: Meter
    version: int
    events: list[Event] = field(default_factory=list)
    written: int = 0  # usage records inserted

    def state(self) -> usage_events.MeterState:
        m = self.meter
        return usage_events.MeterState(
            allocation_id=self.ident.allocation_id,
            tenant_id=self.ident.tenant_id,
            project_id=self.ident.project_id,
            host_id=self.ident.host_id,
            shape=CapacityShape(self.ident.shape),
            gpu_model=self.ident.gpu_model,
            gpu_count=m.gpu_count,
            status="closed" if m.status is MeterStatus.closed else "open",
            opened_at=m.opened_at,
            changed_at=m.changed_at,
            closed_at=m.closed_at,
            version=self.version,
            billed_until=m.billed_until,
            close_reason=m.close_reason,
            suspended_at=m.suspended_at,
            suspend_reason=m.suspend_reason,
            resumed_at=m.resumed_at,
        )

    def emit(self, event_cls: type[Event], *, new_version: bool = True) -> None:
        """A meter event carrying the meter's state (at its next version, unless it is the first)."""
        if new_version:
            self.version += 1
        self.events.append(event_cls.build(data=self.state(), source=SERVICE, actor=SYSTEM))

    async def record(self, session: AsyncSession, windows: list[Window]) -> None:
        """Insert the windows as usage records (a window already recorded is skipped), with their events."""
        if not windows:
            return
        ident = asdict(self.ident)
        stays = (
            await session.execute(
                select(members.c.instance_id, members.c.joined_at, members.c.left_at).where(
                    members.c.allocation_id == self.ident.allocation_id
                )
            )
        ).all()
        rows: list[dict[str, Any]] = [
            {
                "usage_record_id": usage_events.usage_record_id(self.ident.allocation_id, w.start),
                **ident,
                "gpu_count": w.gpu_count,
                "window_start": w.start,
                "window_end": w.end,
                "gpu_seconds": w.gpu_seconds,
                "final": w.final,
                "instance_id": domain.instance_of_window(stays, w.start, w.end),
            }
            for w in windows
        ]
        fresh = set(
            (
                await session.execute(
                    pg_insert(usage_records)
                    .values(rows)
                    .on_conflict_do_nothing()
                    .returning(usage_records.c.usage_record_id)
                )
            ).scalars()
        )
        for r in rows:
            if r["usage_record_id"] in fresh:
                data = usage_events.UsageRecord.model_validate(r | {"shape": CapacityShape(r["shape"])})
                self.events.append(usage_events.UsageRecorded.build(data=data, source=SERVICE, actor=SYSTEM))
        self.written += len(fresh)
        usage_emitted(session, "gpu", len(fresh))

    async def save(self, session: AsyncSession, *, allocation_version: int | None = None, new: bool = False) -> None:
        m = self.meter
        values: dict[str, Any] = {
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
            "version": self.version,
            "updated_at": datetime.now(UTC),
        }
        if allocation_version is not None:
            values["allocation_version"] = allocation_version
        if new:
            await session.execute(insert(meters).values(**asdict(self.ident), **values))
        else:
            await session.execute(
                update(meters).where(meters.c.allocation_id == self.ident.allocation_id).values(**values)
            )


def _release_failed_reason(a: allocation_events.AllocationState) -> str:
    return f"release_requested (release then failed: {a.failure_reason or 'no reason given'})"


async def apply_allocation(session: AsyncSession, event: Event) -> None:
    """Bring the allocation's meter in line with the allocation's full state (event-carried).

    Opens at `activated_at`; a new `gpu_count` changes it at `status_changed_at`; `billing_stopped_at`
    (set at the release request) closes it, whatever later happens to the release. Stale or duplicate
    states (version not newer) are ignored, so replays and redeliveries are no-ops.
    """
    a: allocation_events.AllocationState = event.data
    row = (
        await session.execute(select(meters).where(meters.c.allocation_id == a.allocation_id).with_for_update())
    ).first()
    if row is None:
        if a.activated_at is None:
            return  # never active: never billed (e.g. allocation.failed in provisioning)
        ident = MeterIdent(a.allocation_id, a.tenant_id, a.project_id, a.host_id, str(a.shape), a.gpu_model)
        change = MeterUpdate(ident, Meter.open(a.activated_at, a.gpu_count), version=1)
        change.emit(usage_events.MeterOpened, new_version=False)
        is_new = True
    else:
        if a.version <= row.allocation_version:
            return
        change, is_new = MeterUpdate(MeterIdent.of(row), _meter_of(row), row.version), False
    m = change.meter
    if m.status is not MeterStatus.closed:
        if a.gpu_count != m.gpu_count and not (is_new and a.billing_stopped_at is not None):
            await change.record(session, m.change(a.status_changed_at, a.gpu_count))
            change.emit(usage_events.MeterChanged)
        if a.billing_stopped_at is not None:
            reason = "release_requested"
            if a.status == "release_failed":
                reason = _release_failed_reason(a)
            await change.record(session, m.close(a.billing_stopped_at, reason))
            change.emit(usage_events.MeterClosed)
        elif a.status in ("released", "failed"):
            # Defensive: a release without a release request (should not happen) still stops billing.
            await change.record(
                session, m.close(a.released_at or a.status_changed_at, f"{a.status} without a release request")
            )
            change.emit(usage_events.MeterClosed)
    elif a.status == "release_failed" and m.close_reason == "release_requested":
        # Already closed at the release request; say on the meter that the release then failed.
        m.close_reason = _release_failed_reason(a)
    await change.save(session, allocation_version=a.version, new=is_new)
    await add_events(session, change.events)


async def apply_host(session: AsyncSession, event: Event) -> None:
    """Keep the host projection; a host that heartbeats again resumes its suspended meters."""
    h: allocation_events.HostState = event.data
    row = (await session.execute(select(hosts).where(hosts.c.host_id == h.host_id).with_for_update())).first()
    if row is not None and h.version <= row.version:
        return
    lost = (
        event.type == allocation_events.HostHeartbeatLost.event_type()
        or h.status == allocation_events.HostStatus.unreachable
    )
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
    if lost or h.status == allocation_events.HostStatus.decommissioned:
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
        change = MeterUpdate(MeterIdent.of(r), _meter_of(r), r.version)
        change.meter.resume(resumed_at)
        change.emit(usage_events.MeterResumed)
        await change.save(session)
        events += change.events
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
        change = MeterUpdate(MeterIdent.of(r), _meter_of(r), r.version)
        if r.lost_since is not None and r.lost_since <= lost_before:
            at = domain.suspend_point(r.lost_since, grace)
            await change.record(
                session, change.meter.suspend(at, domain.suspend_reason(r.host_name, r.lost_since, grace))
            )
            change.emit(usage_events.MeterSuspended)
        else:
            await change.record(session, change.meter.record_full_windows(record_until))
        written += change.written
        events += change.events
        await change.save(session)
    await add_events(session, events)
    return len(rows), written


# ------------------------------------------------------------------------------------------ reads


async def get_meter(session: AsyncSession, principal: Principal, allocation_id: uuid.UUID) -> MeterOut:
    """The meter of an allocation; one in a project the caller may not read is answered as absent."""
    row = (await session.execute(select(meters).where(meters.c.allocation_id == allocation_id))).first()
    if row is None:
        raise NotFound("no meter for this allocation", code="meter_not_found")
    await iam.authorize(session, principal, "metering.usage.read", project_id=row.project_id)
    return MeterOut.model_validate(row)


async def list_meters(
    session: AsyncSession, principal: Principal, *, project_id: uuid.UUID | None, status: str | None, limit: int
) -> list[MeterOut]:
    """Meters, newest first: of one project, or of every project the caller may read."""
    q = select(meters).order_by(meters.c.opened_at.desc()).limit(limit)
    if (scope := await readable(session, principal, meters.c.project_id, project_id)) is not None:
        q = q.where(scope)
    if status:
        q = q.where(meters.c.status == status)
    return [MeterOut.model_validate(r) for r in (await session.execute(q)).all()]


async def meter_usage(session: AsyncSession, principal: Principal, allocation_id: uuid.UUID) -> list[UsageRecordOut]:
    """The usage records (closed windows) of an allocation's meter, oldest first."""
    await get_meter(session, principal, allocation_id)
    rows = (
        await session.execute(
            select(usage_records)
            .where(usage_records.c.allocation_id == allocation_id)
            .order_by(usage_records.c.window_start)
        )
    ).all()
    return [UsageRecordOut.model_validate(r) for r in rows]
