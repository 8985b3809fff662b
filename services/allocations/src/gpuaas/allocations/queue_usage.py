"""What each capacity queue holds and waits for, read in one grouped query: the queue views (service/queues.py)
and the metrics scrape (metrics.py) count alike. Its own module so that metrics need not import the service."""

from __future__ import annotations

import uuid
from typing import Literal, NamedTuple

from sqlalchemy import and_, case, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import domain
from gpuaas.allocations.models import allocations, capacity_queues
from gpuaas.contracts.enums import AllocationStatus

# Allocations a queue counts: those holding GPUs, and the queued ones (as waiting).
COUNTED = [*domain.HOLDS_CAPACITY, AllocationStatus.queued]
# The GPUs an allocation holds or asks for: a resize up in flight counts at its target.
GPUS = func.greatest(allocations.c.gpu_count, func.coalesce(allocations.c.target_gpu_count, 0))
# Waiting demand: queued requests, and resizes up that wait on a running allocation (it holds `GPUS` meanwhile).
QUEUED = allocations.c.status == AllocationStatus.queued
RESIZE_WAITS = allocations.c.pending_resize_gpus.is_not(None)
WAITS = or_(QUEUED, RESIZE_WAITS)
# Why a waiting one waits, and the GPUs it waits for (a waiting resize: only its extra GPUs).
WAIT_REASON = case((QUEUED, allocations.c.pending_reason), else_=allocations.c.pending_resize_reason).label("reason")
WAIT_GPUS = case((QUEUED, GPUS), else_=allocations.c.pending_resize_gpus - allocations.c.gpu_count)


class QueueUsage(NamedTuple):
    scope: Literal["tenant", "project"]
    scope_id: uuid.UUID
    gpu_model: str
    guarantee: int
    held: int
    waiting: int


async def configured_usage(session: AsyncSession) -> list[QueueUsage]:
    """Every queue with settings (all pools): its guarantee, the GPUs it holds and its waiting requests, counted
    as `_views` counts them (a waiting resize is a waiting request), in one grouped query (the metrics scrape:
    bounded by the settings rows)."""
    usage = (
        select(
            allocations.c.gpu_model,
            allocations.c.tenant_id,
            allocations.c.project_id,
            func.coalesce(func.sum(GPUS).filter(~QUEUED), 0).label("held"),
            func.count().filter(WAITS).label("waiting"),
        )
        .where(allocations.c.status.in_(COUNTED))
        .group_by(allocations.c.gpu_model, allocations.c.tenant_id, allocations.c.project_id)
        .subquery()
    )
    q = capacity_queues.c
    owner = case((q.scope == "tenant", usage.c.tenant_id), else_=usage.c.project_id)
    rows = await session.execute(
        select(
            q.scope,
            q.scope_id,
            q.gpu_model,
            q.guarantee,
            func.coalesce(func.sum(usage.c.held), 0),
            func.coalesce(func.sum(usage.c.waiting), 0),
        )
        .select_from(capacity_queues.outerjoin(usage, and_(usage.c.gpu_model == q.gpu_model, owner == q.scope_id)))
        .group_by(q.queue_id)
    )
    return [
        QueueUsage(scope, scope_id, model, g, int(held), int(waiting))
        for scope, scope_id, model, g, held, waiting in rows
    ]


async def waiting_by_reason(session: AsyncSession) -> list[tuple[str, str, int]]:
    """(GPU model, reason, count) of the waiting requests of every pool: queued ones and waiting resizes."""
    rows = await session.execute(
        select(allocations.c.gpu_model, WAIT_REASON, func.count())
        .where(allocations.c.status.in_(COUNTED), WAITS)
        .group_by(allocations.c.gpu_model, WAIT_REASON)
    )
    return [(model, reason or "unknown", int(n)) for model, reason, n in rows]
