"""Preemption with notice (issue 29 item 4): schedule a victim's stop, tell it, stop it at the deadline.

The admission engine (`gpuaas.allocations.admission`) chooses victims; this module carries them out, each
step one transaction:
- `schedule`: the victim row records its deadline (now + grace), the request its GPUs are freed for and the
  reason, with a timeline entry, `allocation.preemption_scheduled` in the outbox and a `notify_preemption`
  task (the file /run/gpuaas/preemption inside it, a message on its SSH sessions);
- `stop_due`: at the deadline the victim is stopped through the normal release path (billing stops at the
  release request, once; the release task stops it with SIGTERM, then SIGKILL after the stop timeout) and,
  with `on_preemption=requeue`, a new request with the same spec waits in its queue with its original age;
- `reserved_for`: what the admission engine must know of preemptions under way, so the freed GPUs go to the
  request they were freed for. `preempted_for` stays on the victim row after its stop; it stops mattering
  once that request no longer waits.

A requeued victim is a NEW allocation (`requeued_from` names the stopped one), not the same id put back: a
meter is one allocation's one usage period (opened at activation, closed at the release request), so the
victim's meter closes exactly once at the stop and the re-run gets a meter of its own.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql import alias

from gpuaas.allocations import SERVICE, admission
from gpuaas.allocations.metrics import preemption
from gpuaas.allocations.models import allocations
from gpuaas.allocations.service.common import (
    SYSTEM,
    alloc_state,
    enqueue_task,
    insert_rerun,
    record_timeline,
    update_allocation,
    with_volumes,
)
from gpuaas.allocations.service.lifecycle import request_release
from gpuaas.allocations.service.waiting import enqueue
from gpuaas.contracts import Event
from gpuaas.contracts.agent import NotifyPreemptionTask
from gpuaas.contracts.enums import AllocationStatus, PendingReason
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.kit.outbox import add_event


@dataclass(frozen=True)
class PreemptionConfig:
    enabled: bool = True
    min_runtime_s: float = 600.0
    grace_s: float = 120.0
    stop_timeout_s: float = 10.0


async def reserved_for(session: AsyncSession, model: str) -> dict[uuid.UUID, uuid.UUID]:
    """Victim -> the waiting request it is (or was) stopped for, for the preemptions of the pool whose
    beneficiary still waits."""
    # From the pool's waiting requests (ix_allocations_queued) to their victims (ix_allocations_preempted_for).
    beneficiary = alias(allocations, "beneficiary")
    q = (
        select(allocations.c.allocation_id, allocations.c.preempted_for)
        .select_from(beneficiary)
        .join(allocations, allocations.c.preempted_for == beneficiary.c.allocation_id)
        .where(beneficiary.c.gpu_model == model, beneficiary.c.status == AllocationStatus.queued)
    )
    return {victim: for_id for victim, for_id in (await session.execute(q)).all()}


async def schedule(
    session: AsyncSession, p: admission.Preemption, t: datetime, config: PreemptionConfig
) -> uuid.UUID | None:
    """Schedule one planned preemption; the victim's host (its agent has the notice to deliver), or None when
    the victim is no longer an active allocation or is already being preempted."""
    victim = (
        await session.execute(select(allocations).where(allocations.c.allocation_id == p.victim_id).with_for_update())
    ).first()
    if victim is None or victim.status != AllocationStatus.active or victim.preempt_deadline is not None:
        return None
    deadline = t + timedelta(seconds=config.grace_s)
    row = await update_allocation(
        session,
        p.victim_id,
        preempt_deadline=deadline,
        preempted_for=p.for_allocation_id,
        preemption_reason=p.reason,
        preemption_scheduled_at=t,
    )
    await record_timeline(
        session,
        p.victim_id,
        "preemption",
        "started",
        f"preemption scheduled ({p.reason}): stops at {deadline.isoformat()} "
        f"(in {config.grace_s:.0f}s) for request {p.for_allocation_id}; then "
        + ("back in its queue with its original age" if row.on_preemption == "requeue" else "released"),
    )
    ready_at = deadline + timedelta(seconds=config.stop_timeout_s)  # at the latest: SIGKILL after the stop timeout
    await session.execute(
        allocations.update()
        .where(allocations.c.allocation_id == p.for_allocation_id)
        .values(estimated_start_at=func.greatest(func.coalesce(allocations.c.estimated_start_at, ready_at), ready_at))
    )
    await record_timeline(
        session,
        p.for_allocation_id,
        "queue",
        "info",
        f"allocation {p.victim_id} is preempted for this request: its GPUs are free by {ready_at.isoformat()}",
    )
    await add_event(
        session,
        allocation_events.AllocationPreemptionScheduled.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM),
    )
    await enqueue_task(
        session,
        row.host_id,
        row.allocation_id,
        NotifyPreemptionTask(
            allocation_id=row.allocation_id,
            username=row.ssh_username,
            deadline=deadline,
            reason=p.reason,
            on_preemption=row.on_preemption,
        ),
    )
    preemption(session, row.gpu_model, "scheduled")
    return row.host_id


async def due(session: AsyncSession, t: datetime) -> list[uuid.UUID]:
    """Active victims whose deadline has passed (in one fixed order: replicas lock them one by one)."""
    q = (
        select(allocations.c.allocation_id)
        .where(
            allocations.c.preempt_deadline <= t,
            allocations.c.status == AllocationStatus.active,
            allocations.c.billing_stopped_at.is_(None),
        )
        .order_by(allocations.c.allocation_id)
    )
    return list((await session.execute(q)).scalars())


async def stop_due(session: AsyncSession, alloc_id: uuid.UUID, t: datetime, config: PreemptionConfig) -> Any | None:
    """Stop one victim whose deadline passed (re-checked under its lock); the stopped row, or None. When the
    request it was for no longer waits (cancelled, expired, admitted elsewhere), the preemption is called off."""
    victim = (
        await session.execute(select(allocations).where(allocations.c.allocation_id == alloc_id).with_for_update())
    ).first()
    if (
        victim is None
        or victim.status != AllocationStatus.active
        or victim.preempt_deadline is None
        or victim.preempt_deadline > t
        or victim.billing_stopped_at is not None
    ):
        return None
    waiting = (
        await session.execute(select(allocations.c.status).where(allocations.c.allocation_id == victim.preempted_for))
    ).scalar_one_or_none()
    if waiting != AllocationStatus.queued:
        row = await update_allocation(
            session, alloc_id, preempt_deadline=None, preempted_for=None, preemption_reason=None
        )
        await record_timeline(
            session,
            alloc_id,
            "preemption",
            "succeeded",
            "preemption called off: the request it was for no longer waits",
        )
        await add_event(
            session,
            allocation_events.AllocationPreemptionCancelled.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM),
        )
        preemption(session, row.gpu_model, "called_off")
        return None
    late = (t - victim.preempt_deadline).total_seconds()
    await record_timeline(
        session,
        alloc_id,
        "preemption",
        "succeeded",
        f"stopped at the preemption deadline ({late:.1f}s after it): SIGTERM, SIGKILL after "
        f"{config.stop_timeout_s:.0f}s; on_preemption={victim.on_preemption}",
    )
    row = await request_release(
        session,
        SYSTEM,
        alloc_id,
        reason=f"preempted ({victim.preemption_reason})",
        stop_timeout_s=config.stop_timeout_s,
    )
    if victim.on_preemption == "requeue":
        await requeue(session, victim)
    preemption(session, victim.gpu_model, "stopped")
    return row


async def requeue(session: AsyncSession, victim: Any) -> Any:
    """The victim's spec as a new queued request with the victim's original age (see the module's docstring)."""
    row = await insert_rerun(session, victim, victim.preempt_deadline)
    alloc_id = row.allocation_id
    requested = await with_volumes(session, row)
    events: list[Event] = [
        allocation_events.AllocationRequested.build(data=alloc_state(requested), source=SERVICE, actor=SYSTEM)
    ]
    await record_timeline(
        session, alloc_id, "status", "info", f"requeued: allocation {victim.allocation_id} was preempted"
    )
    row = await enqueue(session, requested, PendingReason.no_capacity, events=events, actor=SYSTEM)
    original = victim.enqueued_at or victim.requested_at
    await session.execute(
        allocations.update().where(allocations.c.allocation_id == alloc_id).values(enqueued_at=original)
    )
    await record_timeline(
        session, victim.allocation_id, "preemption", "info", f"requeued as allocation {alloc_id} with its original age"
    )
    return row


def holds_off(row: Any) -> bool:
    """Never a victim again while its preemption is scheduled (or was carried out)."""
    return row.preempt_deadline is not None
