"""Capacity for operators (issue 21): used and free GPUs per host class over a time range, and which
allocation holds each GPU of each host now (the console's capacity chart and occupancy grid).

There is no capacity history table: the series is reconstructed from what the tables keep. A host's GPUs
count from its enrolment (`created_at`) while it is not decommissioned; an allocation holds its GPUs from
its placement (`requested_at`, placement is part of the create) until it is released (`released_at`; a
failed allocation that no longer has GPU assignments, until its last status change). Each allocation
counts with its current GPU count, so a resized one shows at its new size over its whole life. Each
instant also carries the interval that ends there (since the previous instant): the most GPUs used at once
and the time-weighted mean (`domain.window_use`), so an allocation placed and released between two instants
still shows. The occupancy is exact: it reads `gpu_assignments`, the table that makes double booking
impossible.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel
from sqlalchemy import and_, case, exists, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations.domain import Holding, window_use
from gpuaas.allocations.models import allocations, gpu_assignments, hosts


class CapacityPoint(BaseModel):
    at: datetime
    total: int
    used: int  # at this instant
    free: int
    peak_used: int  # the most used at once in the interval since the previous instant
    mean_used: float  # the time-weighted mean used over that interval


class ClassCapacity(BaseModel):
    host_class: str | None
    hosts: int
    total_gpus: int
    used_gpus: int  # now, from the GPU assignments
    points: list[CapacityPoint]


class GpuSlot(BaseModel):
    index: int
    model: str
    allocation_id: uuid.UUID | None = None
    allocation_name: str | None = None
    tenant_id: uuid.UUID | None = None
    project_id: uuid.UUID | None = None
    status: str | None = None


class HostOccupancy(BaseModel):
    host_id: uuid.UUID
    name: str
    host_class: str | None
    status: str
    gpus: list[GpuSlot]


class Capacity(BaseModel):
    since: datetime
    until: datetime
    classes: list[ClassCapacity]
    hosts: list[HostOccupancy]


async def capacity(session: AsyncSession, *, hours: int, points: int, now: datetime | None = None) -> Capacity:
    """`points` evenly spaced instants over the last `hours` (the last one is now), per host class."""
    until = now or datetime.now(UTC)
    since = until - timedelta(hours=hours)
    step = (until - since) / (points - 1)
    instants = [since + step * i for i in range(points)]
    host_rows = (
        await session.execute(select(hosts).where(hosts.c.status != "decommissioned").order_by(hosts.c.name))
    ).all()
    held = exists().where(gpu_assignments.c.allocation_id == allocations.c.allocation_id)
    ends = case(
        (allocations.c.released_at.is_not(None), allocations.c.released_at),
        (and_(allocations.c.status == "failed", ~held), allocations.c.status_changed_at),
        else_=None,
    ).label("ends")
    alloc_rows = (
        await session.execute(
            select(allocations.c.host_id, allocations.c.gpu_count, allocations.c.requested_at, ends).where(
                allocations.c.host_id.is_not(None),
                allocations.c.requested_at <= until,
                (allocations.c.released_at.is_(None)) | (allocations.c.released_at > since - step),
            )
        )
    ).all()
    occupied = {
        (r.host_id, r.gpu_index): r
        for r in (
            await session.execute(
                select(
                    gpu_assignments.c.host_id,
                    gpu_assignments.c.gpu_index,
                    allocations.c.allocation_id,
                    allocations.c.name,
                    allocations.c.tenant_id,
                    allocations.c.project_id,
                    allocations.c.status,
                ).join(allocations, allocations.c.allocation_id == gpu_assignments.c.allocation_id)
            )
        ).all()
    }
    class_of = {h.host_id: h.host_class for h in host_rows}
    by_class: dict[str | None, list[Any]] = {}
    for h in host_rows:
        by_class.setdefault(h.host_class, []).append(h)
    classes = []
    for name, members in sorted(by_class.items(), key=lambda kv: kv[0] or ""):
        series = []
        holdings = [
            Holding(a.gpu_count, a.requested_at.timestamp(), a.ends.timestamp() if a.ends else None)
            for a in alloc_rows
            if class_of.get(a.host_id, "\0") == name
        ]
        for t in instants:
            total = sum(len(h.gpus or []) for h in members if h.created_at <= t)
            at = t.timestamp()
            used = min(total, sum(h.gpus for h in holdings if h.start <= at and (h.end is None or h.end > at)))
            peak, mean = window_use(holdings, at - step.total_seconds(), at)
            # Clamped like `used`: a resized allocation counts at its current size over its whole life.
            peak, mean = min(peak, total), min(mean, total)
            series.append(
                CapacityPoint(at=t, total=total, used=used, free=total - used, peak_used=peak, mean_used=mean)
            )
        member_ids = {h.host_id for h in members}
        classes.append(
            ClassCapacity(
                host_class=name,
                hosts=len(members),
                total_gpus=sum(len(h.gpus or []) for h in members),
                used_gpus=sum(1 for host_id, _ in occupied if host_id in member_ids),
                points=series,
            )
        )
    grid = []
    for h in host_rows:
        slots = []
        for g in sorted(h.gpus or [], key=lambda g: g["index"]):
            a = occupied.get((h.host_id, g["index"]))
            slots.append(
                GpuSlot(
                    index=g["index"],
                    model=g.get("model", ""),
                    allocation_id=a.allocation_id if a else None,
                    allocation_name=a.name if a else None,
                    tenant_id=a.tenant_id if a else None,
                    project_id=a.project_id if a else None,
                    status=a.status if a else None,
                )
            )
        grid.append(HostOccupancy(host_id=h.host_id, name=h.name, host_class=h.host_class, status=h.status, gpus=slots))
    return Capacity(since=since, until=until, classes=classes, hosts=grid)
