"""Requests that wait for capacity (issue 29): enqueue a create that cannot be placed now, its position in its
project's queue, cancel it (released, nothing held, no agent task) and fail it past its `max_wait`; and a resize
up that waits for GPUs on its allocation's host (`queue_resize`, `cancel_resize`): the allocation runs on with
its current GPUs and the admission runner grants the resize in its turn.

A `queued` allocation holds no GPUs and counts against no quota; the admission runner
(`service.admission_runner`) moves it on to `provisioning` together with a placement.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import and_, exists, func, or_, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import SERVICE, domain
from gpuaas.allocations.metrics import refused
from gpuaas.allocations.models import allocations, capacity_queues
from gpuaas.allocations.service.common import (
    alloc_state,
    now,
    poke_admission,
    record_timeline,
    transition,
    update_allocation,
    with_volumes,
)
from gpuaas.allocations.service.quotas import check_quota
from gpuaas.allocations.service.volumes import detach_all
from gpuaas.contracts import Actor, Event
from gpuaas.contracts.enums import AllocationStatus, PendingReason
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.kit.errors import Conflict, Problem
from gpuaas.kit.outbox import add_events

# Reasons of waiting requests that compete for free GPUs: a new create of the pool waits behind them rather
# than taking GPUs freed for them (a request waiting only on its own limit competes for nothing).
COMPETING = (PendingReason.no_capacity, PendingReason.waiting_for_preemption)

REASON_TEXT = {
    PendingReason.no_capacity: "no ready host has the requested GPUs free",
    PendingReason.over_limit: "the project is at its GPU limit (queue limit or quota)",
    PendingReason.over_tenant_limit: "the tenant is at its GPU limit in this pool",
    PendingReason.waiting_for_preemption: "GPUs borrowed by others are being reclaimed for it",
}


async def others_waiting(session: AsyncSession, gpu_model: str, alloc_id: uuid.UUID) -> bool:
    """Whether requests of this pool wait for free GPUs (so a new one queues behind them): queued creates and
    resizes up waiting for GPUs on their host."""
    a = allocations.c
    q = exists().where(
        a.gpu_model == gpu_model,
        a.allocation_id != alloc_id,
        or_(
            and_(a.status == AllocationStatus.queued, a.pending_reason.in_(list(COMPETING))),
            and_(a.pending_resize_gpus.is_not(None), a.pending_resize_reason == PendingReason.no_capacity),
        ),
    )
    return bool((await session.execute(select(q))).scalar())


async def over_queue_limit(
    session: AsyncSession, tenant_id: uuid.UUID, project_id: uuid.UUID, gpu_model: str, extra: int
) -> PendingReason | None:
    """Whether `extra` more GPUs of the pool would take the project or its tenant past its queue's limit.
    Serialised per tenant and pool (the lock queue changes take too) where a limit is set, so that two
    creates, or a create and an admission, cannot both pass it."""
    limits = (
        await session.execute(
            select(capacity_queues.c.scope, capacity_queues.c.limit).where(
                capacity_queues.c.gpu_model == gpu_model,
                capacity_queues.c.limit.is_not(None),
                or_(
                    and_(capacity_queues.c.scope == "tenant", capacity_queues.c.scope_id == tenant_id),
                    and_(capacity_queues.c.scope == "project", capacity_queues.c.scope_id == project_id),
                ),
            )
        )
    ).all()
    if not limits:
        return None
    await lock_tenant_pool(session, tenant_id, gpu_model)
    gpus = func.greatest(allocations.c.gpu_count, func.coalesce(allocations.c.target_gpu_count, 0))
    held = select(func.coalesce(func.sum(gpus), 0)).where(
        allocations.c.gpu_model == gpu_model, allocations.c.status.in_(list(domain.HOLDS_CAPACITY))
    )
    for scope, limit in sorted(limits, key=lambda r: r.scope != "project"):  # the project's own limit first
        column = allocations.c.project_id if scope == "project" else allocations.c.tenant_id
        used = int(
            (
                await session.execute(held.where(column == (project_id if scope == "project" else tenant_id)))
            ).scalar_one()
        )
        if used + extra > limit:
            return PendingReason.over_limit if scope == "project" else PendingReason.over_tenant_limit
    return None


async def limits_wait(
    session: AsyncSession, tenant_id: uuid.UUID, project_id: uuid.UUID, gpu_model: str, gpus: int, *, queue: bool
) -> PendingReason | None:
    """Whether `gpus` more GPUs must wait for the project's quota or a queue limit (the reason), else None;
    with `queue` false the 409 (`quota_exceeded`, `queue_limit_exceeded`) instead of waiting."""
    try:
        await check_quota(session, project_id, gpus, count_refusal=not queue)
    except Conflict as exc:
        if not queue or exc.code != "quota_exceeded":
            raise
        return PendingReason.over_limit
    waits_for = await over_queue_limit(session, tenant_id, project_id, gpu_model, gpus)
    if waits_for is not None and not queue:
        refused(session, "queue_limit_exceeded")
        raise Conflict(
            f"the {'project' if waits_for is PendingReason.over_limit else 'tenant'}'s {gpu_model} queue is at "
            "its limit",
            code="queue_limit_exceeded",
            reason=waits_for.value,
        )
    return waits_for


async def lock_tenant_pool(session: AsyncSession, tenant_id: uuid.UUID, gpu_model: str) -> None:
    """Serialise changes of one tenant's share of one pool (queue settings, limit checks)."""
    await session.execute(
        text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 29))"), {"k": f"queues:{tenant_id}:{gpu_model}"}
    )


async def position_in_queue(session: AsyncSession, row: Any) -> int:
    """1-based place in its project's queue of its pool: higher priority first, then older."""
    ahead = await session.execute(
        select(func.count()).where(
            allocations.c.status == AllocationStatus.queued,
            allocations.c.project_id == row.project_id,
            allocations.c.gpu_model == row.gpu_model,
            allocations.c.allocation_id != row.allocation_id,
            or_(
                allocations.c.priority > row.priority,
                and_(allocations.c.priority == row.priority, allocations.c.enqueued_at <= row.enqueued_at),
            ),
        )
    )
    return int(ahead.scalar_one()) + 1


async def enqueue(
    session: AsyncSession, requested: Any, reason: PendingReason, *, events: list[Event], actor: Actor
) -> Any:
    """requested -> queued with its reason and position, on the timeline and in the outbox (`events` plus
    allocation.queued), and the runners poked once this commits."""
    t = now()
    row = await transition(session, requested, AllocationStatus.queued, pending_reason=reason, enqueued_at=t)
    position = await position_in_queue(session, row)
    row = await _set(session, row, queue_position=position)
    await record_timeline(
        session,
        row.allocation_id,
        "queue",
        "started",
        f"waiting in the {row.gpu_model} queue: {REASON_TEXT[reason]}; position {position} in the project's queue"
        + (f"; gives up after {row.max_wait_s}s" if row.max_wait_s else ""),
    )
    events.append(allocation_events.AllocationQueued.build(data=alloc_state(row), source=SERVICE, actor=actor))
    await add_events(session, events)
    await poke_admission(session, row.gpu_model)
    return row


async def cancel_queued(session: AsyncSession, alloc: Any, actor: Actor) -> Any:
    """Release a waiting request: it held nothing, so it ends at once (no agent task)."""
    await detach_all(session, alloc.allocation_id, deleting=True)
    row = await transition(
        session,
        alloc,
        AllocationStatus.released,
        released_at=now(),
        pending_reason=None,
        queue_position=None,
    )
    await record_timeline(session, alloc.allocation_id, "queue", "failed", "cancelled while waiting")
    await add_events(
        session, [allocation_events.AllocationReleased.build(data=alloc_state(row), source=SERVICE, actor=actor)]
    )
    await poke_admission(session, row.gpu_model)  # the positions behind it move up
    return row


async def expire_queued(session: AsyncSession, alloc: Any, actor: Actor) -> Any:
    """A request that waited past its `max_wait`: failed with the reason it was waiting for."""
    reason = PendingReason(alloc.pending_reason or PendingReason.no_capacity)
    failure = f"waited {alloc.max_wait_s}s (max_wait) without being admitted: {reason.value}"
    return await _fail_queued(session, alloc, failure, f"max_wait passed: {REASON_TEXT[reason]}", actor)


async def refuse_queued(session: AsyncSession, alloc: Any, problem: Problem, actor: Actor) -> Any:
    """A request that GPUs were found for but that cannot run as asked (its runtime left the catalog, say):
    failed with the problem a create placed at once would have answered, so it never blocks its pool."""
    failure = f"could not be admitted: {problem.detail} ({problem.code})"
    return await _fail_queued(session, alloc, failure, failure, actor)


async def _fail_queued(session: AsyncSession, alloc: Any, failure: str, note: str, actor: Actor) -> Any:
    await detach_all(session, alloc.allocation_id, deleting=False)
    row = await transition(session, alloc, AllocationStatus.failed, failure_reason=failure, queue_position=None)
    await record_timeline(session, alloc.allocation_id, "queue", "failed", note)
    await add_events(
        session, [allocation_events.AllocationFailed.build(data=alloc_state(row), source=SERVICE, actor=actor)]
    )
    return row


async def _set(session: AsyncSession, row: Any, **values: Any) -> Any:
    """Queue bookkeeping on the row (no version bump: position changes are not changes of the allocation)."""
    updated = (
        await session.execute(
            allocations.update()
            .where(allocations.c.allocation_id == row.allocation_id)
            .values(**values)
            .returning(*allocations.c)
        )
    ).one()
    return await with_volumes(session, updated)


async def queue_resize(session: AsyncSession, alloc: Any, gpu_count: int, reason: PendingReason, actor: Actor) -> Any:
    """A resize up of an active allocation that cannot be granted now waits: the size asked and why on the row
    (a version bump: the allocation's view changed), a timeline entry, `allocation.resize_queued`, the runners
    poked. It holds no extra GPUs and counts against no quota until granted."""
    row = await update_allocation(
        session,
        alloc.allocation_id,
        pending_resize_gpus=gpu_count,
        pending_resize_reason=reason,
        pending_resize_since=now(),
        failure_reason=None,
    )
    why = "its host has not enough free GPUs" if reason is PendingReason.no_capacity else REASON_TEXT[reason]
    await record_timeline(
        session,
        alloc.allocation_id,
        "resize.queue",
        "started",
        f"resize to {gpu_count} GPUs waits: {why}; it keeps its {alloc.gpu_count} GPUs meanwhile",
    )
    await add_events(
        session, [allocation_events.AllocationResizeQueued.build(data=alloc_state(row), source=SERVICE, actor=actor)]
    )
    await poke_admission(session, row.gpu_model)
    return row


async def cancel_resize(session: AsyncSession, alloc: Any, actor: Actor, note: str) -> Any:
    """Drop a waiting resize (the row locked by the caller): nothing was reserved, so nothing else changes."""
    row = await update_allocation(
        session, alloc.allocation_id, pending_resize_gpus=None, pending_resize_reason=None, pending_resize_since=None
    )
    await record_timeline(session, alloc.allocation_id, "resize.queue", "failed", note)
    await add_events(
        session,
        [allocation_events.AllocationResizeCancelled.build(data=alloc_state(row), source=SERVICE, actor=actor)],
    )
    await poke_admission(session, row.gpu_model)  # the requests behind it move up
    return row
