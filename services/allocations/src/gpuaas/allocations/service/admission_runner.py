"""The admission cycle of one pool (GPU model): read the pool, ask `admission.plan` who runs next, apply it.

One transaction per pool and cycle, under a transaction-scoped advisory lock on the pool, so two replicas
never run one pool's cycle at once (the second waits, then plans from what the first committed: no lost
wake-up), and a replica killed mid-cycle leaves nothing behind (its transaction rolls back, the lock goes
with it). Each admission is then applied exactly as placement does: the allocation row locked and still
`queued`, the project's quota checked under its advisory lock (what creates take), the host row locked and
its capacity re-read before GPUs are inserted into gpu_assignments (whose primary key is the last defence),
each in a savepoint, so one admission that no longer fits leaves the others. An admitted request goes
queued -> provisioning through the create's own path (`lifecycle.admit`: runtime, limits, provision task).

Preemption (issue 29 item 4): the engine's planned preemptions are scheduled in the same transaction
(`service.preemption.schedule`: deadline, notice, event, agent task); the reconciler stops victims at their
deadline. The engine is told which victims are already spoken for (`reserved_for`, persisted on the victim
rows), so GPUs freed by a preemption are held for the request they were freed for. An allocation already
being preempted is never chosen again.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import admission, domain
from gpuaas.allocations.metrics import admitted
from gpuaas.allocations.models import allocations, capacity_queues, gpu_assignments, host_capacity, hosts, quotas
from gpuaas.allocations.queue_usage import WAITS
from gpuaas.allocations.service.common import SYSTEM, now, record_timeline, with_volumes
from gpuaas.allocations.service.lifecycle import admit
from gpuaas.allocations.service.placement import TenancyRefused, capacities, place, reserve_on
from gpuaas.allocations.service.preemption import PreemptionConfig, holds_off, reserved_for, schedule
from gpuaas.allocations.service.quotas import check_quota
from gpuaas.allocations.service.resizes import start_resize
from gpuaas.allocations.service.waiting import REASON_TEXT, expire_queued, over_queue_limit, refuse_queued
from gpuaas.contracts.enums import AllocationStatus, CapacityShape, PendingReason
from gpuaas.contracts.events.allocations import HostStatus
from gpuaas.kit.errors import Conflict, Problem, Unprocessable

_LOCK_SALT = 29  # the advisory lock key space of admission cycles (hashtextextended's seed)


@dataclass
class CycleResult:
    admitted: list[uuid.UUID] = field(default_factory=list)
    preempted: list[uuid.UUID] = field(default_factory=list)  # victims whose preemption was scheduled
    expired: list[uuid.UUID] = field(default_factory=list)
    refused: list[uuid.UUID] = field(default_factory=list)  # placed, but cannot run as asked: failed
    hosts: set[uuid.UUID] = field(default_factory=set)  # hosts whose agents have new work


def project_queue(project_id: uuid.UUID) -> str:
    return f"project:{project_id}"


def tenant_queue(tenant_id: uuid.UUID) -> str:
    return f"tenant:{tenant_id}"


async def pools_waiting(session: AsyncSession) -> list[str]:
    """GPU models with queued requests or waiting resizes (the pools that need a cycle), in one query."""
    q = select(allocations.c.gpu_model).where(WAITS).distinct()
    return sorted((await session.execute(q)).scalars())


async def run_cycle(session: AsyncSession, model: str, preemption: PreemptionConfig | None = None) -> CycleResult:
    """One admission cycle of the pool `model`, in the caller's transaction (which must commit it).
    `preemption`: None plans without preemption."""
    await session.execute(
        text("SELECT pg_advisory_xact_lock(hashtextextended(:k, :salt))"),
        {"k": f"admission:{model}", "salt": _LOCK_SALT},
    )
    t = now()
    result = CycleResult()
    a = allocations.c
    queued = (
        await session.execute(
            # only what planning reads (the whole row, JSON included, cost ~2x at 10k waiting); an admission
            # re-reads its row whole under its lock
            select(
                a.allocation_id,
                a.project_id,
                a.tenant_id,
                a.shape,
                a.gpu_count,
                a.host_class,
                a.priority,
                a.enqueued_at,
                a.max_wait_s,
                a.pending_reason,
                a.queue_position,
            )
            .where(a.status == AllocationStatus.queued, a.gpu_model == model)
            .order_by(a.enqueued_at, a.allocation_id)
        )
    ).all()
    waiting_rows = []
    for row in queued:
        if row.max_wait_s and row.enqueued_at + timedelta(seconds=row.max_wait_s) <= t:
            locked = await _lock_queued(session, row.allocation_id)
            if locked is not None:
                await expire_queued(session, locked, SYSTEM)
                result.expired.append(row.allocation_id)
        else:
            waiting_rows.append(row)
    # Resizes up waiting for GPUs on their own host (active allocations: one restarting or resizing waits on).
    resizes = (
        await session.execute(
            select(
                a.allocation_id,
                a.project_id,
                a.tenant_id,
                a.gpu_count,
                a.host_id,
                a.priority,
                a.pending_resize_gpus,
                a.pending_resize_reason,
                a.pending_resize_since,
            )
            .where(a.pending_resize_gpus.is_not(None), a.gpu_model == model, a.status == AllocationStatus.active)
            .order_by(a.pending_resize_since, a.allocation_id)
        )
    ).all()
    if not waiting_rows and not resizes:
        return result
    running = (
        await session.execute(
            select(
                allocations.c.allocation_id,
                allocations.c.project_id,
                allocations.c.tenant_id,
                func.greatest(allocations.c.gpu_count, func.coalesce(allocations.c.target_gpu_count, 0)).label("gpus"),
                allocations.c.priority,
                func.coalesce(allocations.c.activated_at, allocations.c.status_changed_at).label("started_at"),
                allocations.c.host_id,
                allocations.c.preempt_deadline,
            ).where(
                allocations.c.gpu_model == model,
                allocations.c.status.in_(list(domain.HOLDS_CAPACITY)),
                allocations.c.host_id.is_not(None),
            )
        )
    ).all()
    settings = await _queue_settings(session, model, waiting_rows, running)
    ready = select(host_capacity.c.host_id).join(hosts, hosts.c.host_id == host_capacity.c.host_id)
    ready = ready.where(host_capacity.c.gpu_model == model, hosts.c.status == HostStatus.ready)
    host_ids = list((await session.execute(ready)).scalars())
    # In a worker thread: plan() is pure CPU (~0.1-0.3 s at 10k waiting requests) and would otherwise stall every
    # request this replica serves meanwhile (measured: enqueue p99 947 ms with it on the event loop).
    plan = await asyncio.to_thread(
        admission.plan,
        model=model,
        queues=settings,
        running=[
            admission.Running(
                allocation_id=r.allocation_id,
                queue_id=project_queue(r.project_id),
                gpus=r.gpus,
                priority=r.priority,
                started_at=r.started_at.timestamp(),
                preemptible=not holds_off(r),
                host_id=r.host_id,
                tenant_id=r.tenant_id,
            )
            for r in running
        ],
        waiting=[
            admission.Waiting(
                allocation_id=w.allocation_id,
                queue_id=project_queue(w.project_id),
                tenant_id=w.tenant_id,
                shape=CapacityShape(w.shape),
                count=w.gpu_count,
                host_class=w.host_class,
                priority=w.priority,
                enqueued_at=w.enqueued_at.timestamp(),
            )
            for w in waiting_rows
        ]
        + [
            admission.Waiting(
                allocation_id=r.allocation_id,
                queue_id=project_queue(r.project_id),
                tenant_id=r.tenant_id,
                shape=CapacityShape.gpu_slice,
                count=r.pending_resize_gpus - r.gpu_count,
                host_class=None,
                priority=r.priority,
                enqueued_at=r.pending_resize_since.timestamp(),
                host_id=r.host_id,
            )
            for r in resizes
        ],
        hosts=await capacities(session, host_ids) if host_ids else [],
        now=t.timestamp(),
        reserved_for=await reserved_for(session, model) if preemption else None,
        config=admission.AdmissionConfig(
            preemption=preemption is not None and preemption.enabled,
            min_runtime=preemption.min_runtime_s if preemption else admission.AdmissionConfig.min_runtime,
        ),
    )
    by_id = {w.allocation_id: w for w in waiting_rows}
    resize_of = {r.allocation_id: r for r in resizes}
    pending = {p.allocation_id: p for p in plan.pending}
    for a in plan.admissions:
        if a.allocation_id in resize_of:  # a resize up granted on its host
            granted = await _apply_resize(session, a, t)
            if granted is None:
                pending[a.allocation_id] = admission.Pending(a.allocation_id, PendingReason.no_capacity, 1)
            else:
                result.admitted.append(a.allocation_id)
                result.hosts.add(granted)
            continue
        outcome = await _apply(session, a, t)
        if isinstance(outcome, uuid.UUID):
            result.admitted.append(a.allocation_id)
            result.hosts.add(outcome)
        elif isinstance(outcome, Problem):
            row = await _lock_queued(session, a.allocation_id)
            if row is not None:
                await refuse_queued(session, row, outcome, SYSTEM)
                result.refused.append(a.allocation_id)
        elif outcome is not None:  # refused under the locks: it stays first in its project's queue
            pending[a.allocation_id] = admission.Pending(a.allocation_id, outcome, 1)
    for p in plan.preemptions:
        assert preemption is not None  # the engine plans none without it
        host_id = await schedule(session, p, t, preemption)
        if host_id is not None:
            result.preempted.append(p.victim_id)
            result.hosts.add(host_id)
    for p in pending.values():
        row = by_id.get(p.allocation_id)
        if row is not None:
            await _note_pending(session, row, PendingReason(p.reason), p.position)
        elif p.allocation_id in resize_of and resize_of[p.allocation_id].pending_resize_reason != p.reason:
            await session.execute(  # no version bump: the reason is bookkeeping, as a queued request's position
                update(allocations)
                .where(allocations.c.allocation_id == p.allocation_id, allocations.c.pending_resize_gpus.is_not(None))
                .values(pending_resize_reason=PendingReason(p.reason))
            )
    return result


async def _apply_resize(session: AsyncSession, a: admission.Admission, t: datetime) -> uuid.UUID | None:
    """Grant one planned resize up in a savepoint, as the resize request itself would: the allocation row locked
    and still active with the same resize waiting on the same host, the quota and queue limits re-checked under
    their locks, the host row locked and its free GPUs re-read before the extra ones go into gpu_assignments.
    The host, or None when it no longer fits (it keeps waiting)."""
    async with session.begin_nested() as savepoint:
        granted = await _resize_still_fits(session, a)
        if granted is None:
            await savepoint.rollback()
            return None
        row, free = granted
        need = len(a.gpu_indices)
        extra = sorted(a.gpu_indices) if set(a.gpu_indices) <= set(free) else sorted(free)[:need]
        await session.execute(
            insert(gpu_assignments),
            [{"host_id": row.host_id, "gpu_index": i, "allocation_id": row.allocation_id} for i in extra],
        )
        waited = (t - row.pending_resize_since).total_seconds()
        await record_timeline(
            session, row.allocation_id, "resize.queue", "succeeded", f"resize granted after waiting {waited:.1f}s"
        )
        await start_resize(session, await with_volumes(session, row), sorted([*row.gpu_indices, *extra]), actor=SYSTEM)
        admitted(session, row.gpu_model, waited)
        return row.host_id


async def _resize_still_fits(session: AsyncSession, a: admission.Admission) -> tuple[Any, list[int]] | None:
    """The allocation row (locked) and its host's free GPUs (the host row locked), when the planned resize still
    holds: the same resize waits on the same host of an active allocation, within its quota and queue limits,
    on a ready host with enough free GPUs. None otherwise."""
    row = (
        await session.execute(
            select(allocations).where(allocations.c.allocation_id == a.allocation_id).with_for_update()
        )
    ).first()
    need = len(a.gpu_indices)
    if (
        row is None
        or row.status != AllocationStatus.active
        or row.pending_resize_gpus is None
        or row.host_id != a.host_id
        or row.pending_resize_gpus - row.gpu_count != need
    ):
        return None
    try:
        await check_quota(session, row.project_id, need, count_refusal=False)
    except Conflict:
        return None
    if await over_queue_limit(session, row.tenant_id, row.project_id, row.gpu_model, need) is not None:
        return None
    host = (await session.execute(select(hosts).where(hosts.c.host_id == row.host_id).with_for_update())).one()
    free = (await capacities(session, [row.host_id], host_rows=[host]))[0].free(row.gpu_model)
    if host.status != HostStatus.ready or len(free) < need:
        return None
    return row, free


async def _lock_queued(session: AsyncSession, alloc_id: uuid.UUID) -> Any | None:
    """The allocation row locked, if it is still queued (a cancel may have ended it meanwhile)."""
    row = (
        await session.execute(select(allocations).where(allocations.c.allocation_id == alloc_id).with_for_update())
    ).first()
    return await with_volumes(session, row) if row is not None and row.status == AllocationStatus.queued else None


async def _apply(
    session: AsyncSession, a: admission.Admission, t: datetime
) -> uuid.UUID | PendingReason | Problem | None:
    """Admit one planned request in a savepoint: the host it now runs on, else why it still waits, or the
    problem that keeps it from ever running (None: it is no longer queued)."""
    async with session.begin_nested() as savepoint:
        row = await _lock_queued(session, a.allocation_id)
        if row is None:
            await savepoint.rollback()
            return None
        try:
            await check_quota(session, row.project_id, len(a.gpu_indices), count_refusal=False)
        except Conflict:
            await savepoint.rollback()
            return PendingReason.over_limit
        limited = await over_queue_limit(session, row.tenant_id, row.project_id, row.gpu_model, len(a.gpu_indices))
        if limited is not None:
            await savepoint.rollback()
            return limited
        shape = CapacityShape(row.shape)
        count = row.gpu_count if shape is CapacityShape.gpu_slice else None
        common = {
            "shape": shape,
            "model": row.gpu_model,
            "count": count,
            "host_class": row.host_class,
            "alloc_id": row.allocation_id,
            "tenant_id": row.tenant_id,
        }
        placed: tuple[Any, list[int]] | None = None
        try:
            placed = await reserve_on(
                session,
                a.host_id,
                container_only=row.requested_runtime is not None,
                prefer=list(a.gpu_indices),
                **common,
            )
        except TenancyRefused:
            placed = None
        if placed is None:  # the planned host no longer fits (tenancy, driver, a racing create): any other
            try:
                placed = await place(
                    session, container_only=row.requested_runtime is not None, count_refusal=False, **common
                )
            except (Conflict, Unprocessable):
                await savepoint.rollback()
                return PendingReason.no_capacity
        host, picked = placed
        try:
            await admit(session, row, host, picked, events=[], actor=SYSTEM)
        except Problem as exc:  # it cannot run as asked (its runtime left the catalog): fail it, not the cycle
            await savepoint.rollback()
            return exc
        waited = (t - row.enqueued_at).total_seconds()
        await record_timeline(session, row.allocation_id, "queue", "succeeded", f"admitted after waiting {waited:.1f}s")
        admitted(session, row.gpu_model, waited)
        return host.host_id


async def _note_pending(session: AsyncSession, row: Any, reason: PendingReason, position: int) -> None:
    """Keep a waiting request's reason and position current; a new reason goes on its timeline."""
    if row.pending_reason == reason and row.queue_position == position:
        return
    await session.execute(
        update(allocations)
        .where(allocations.c.allocation_id == row.allocation_id, allocations.c.status == AllocationStatus.queued)
        .values(pending_reason=reason, queue_position=position)
    )
    if row.pending_reason != reason:
        await record_timeline(session, row.allocation_id, "queue", "info", f"waiting: {REASON_TEXT[reason]}")


async def _queue_settings(
    session: AsyncSession, model: str, waiting: Sequence[Any], running: Sequence[Any]
) -> dict[str, admission.QueueSettings]:
    """The pool's queues for the engine: every tenant and project queue with settings, every project that
    runs or waits here (its tenant as parent), and a project's GPU quota as its limit across models (what it
    may still hold in this pool: the quota minus what it holds of other models)."""
    out: dict[str, admission.QueueSettings] = {}
    tenant_of: dict[uuid.UUID, uuid.UUID] = {}
    for r in [*waiting, *running]:
        tenant_of[r.project_id] = r.tenant_id
    for q in (await session.execute(select(capacity_queues).where(capacity_queues.c.gpu_model == model))).all():
        if q.scope == "tenant":
            qid, parent = tenant_queue(q.scope_id), None
        else:
            qid, parent = project_queue(q.scope_id), tenant_queue(q.tenant_id)
            tenant_of[q.scope_id] = q.tenant_id
        out[qid] = admission.QueueSettings(
            qid, parent, guarantee=q.guarantee, limit=q.limit, lend_limit=q.lend_limit, weight=q.weight
        )
    for pid, tid in tenant_of.items():
        out.setdefault(project_queue(pid), admission.QueueSettings(project_queue(pid), tenant_queue(tid)))
    if tenant_of:
        capped = (
            await session.execute(
                select(quotas.c.project_id, quotas.c.max_gpus).where(quotas.c.project_id.in_(list(tenant_of)))
            )
        ).all()
        elsewhere: dict[uuid.UUID, int] = {}
        if capped:
            held = await session.execute(
                select(
                    allocations.c.project_id,
                    func.sum(func.greatest(allocations.c.gpu_count, func.coalesce(allocations.c.target_gpu_count, 0))),
                )
                .where(
                    allocations.c.project_id.in_([c.project_id for c in capped]),
                    allocations.c.gpu_model != model,
                    allocations.c.status.in_(list(domain.HOLDS_CAPACITY)),
                )
                .group_by(allocations.c.project_id)
            )
            elsewhere = {pid: int(n) for pid, n in held.all()}
        for c in capped:
            qid = project_queue(c.project_id)
            s = out[qid]
            room = max(c.max_gpus - elsewhere.get(c.project_id, 0), 0)
            limit = room if s.limit is None else min(s.limit, room)
            out[qid] = admission.QueueSettings(
                qid, s.parent, guarantee=min(s.guarantee, limit), limit=limit, lend_limit=s.lend_limit, weight=s.weight
            )
    return out
