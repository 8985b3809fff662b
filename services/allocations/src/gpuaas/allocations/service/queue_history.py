"""Each capacity queue's share of its pool over time (issue 29): the GPUs each queue held at evenly spaced
instants of a window, for the console's queue page. Operators see every tenant's queue; a tenant admin sees
the tenant's queue and its projects' queues.

There is no history table: as the capacity series (`service/capacity.py`, issue 21) does, the series is
reconstructed from the allocations table. An allocation holds its GPUs from its placement until its release
(`released_at`; a failed allocation that no longer has GPU assignments, until its last status change). The
placement is the create (`requested_at`) unless the request waited in the queue: then it is the admission
(the timeline's `queue`/`succeeded` entry). A request that never got GPUs (cancelled or failed while queued)
holds nothing. Each allocation counts with its current GPU count, so a resized one shows at its new size
over its whole life. Each instant also carries the interval that ends there (since the previous instant):
the most GPUs held at once and the time-weighted mean (`domain.window_use`).
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Literal

from pydantic import BaseModel, Field
from sqlalchemy import and_, case, exists, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations.domain import Holding, window_use
from gpuaas.allocations.models import allocations, capacity_queues, gpu_assignments, timeline
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Unprocessable

MAX_WINDOW = timedelta(days=62)
DEFAULT_WINDOW = timedelta(hours=24)
EARLIEST = timedelta(days=3653)  # how far back a window may start (and the calendar arithmetic stays in range)


class SharePoint(BaseModel):
    at: datetime
    held: int = Field(description="GPUs the queue's allocations held at this instant")
    peak: int = Field(description="the most held at once in the interval since the previous instant")
    mean: float = Field(description="the time-weighted mean held over that interval")


class QueueShare(BaseModel):
    scope: Literal["tenant", "project"]
    scope_id: uuid.UUID
    tenant_id: uuid.UUID
    gpu_model: str
    guarantee: int = Field(0, description="the queue's guarantee now (0 without settings)")
    weight: float = Field(1.0, description="the queue's weight now")
    points: list[SharePoint]


class QueueHistory(BaseModel):
    since: datetime
    until: datetime
    queues: list[QueueShare]


def window(since: datetime | None, until: datetime | None, now: datetime) -> tuple[datetime, datetime]:
    """The window asked for: `until` defaults to now, `since` to 24 h before `until`. 422 `invalid_window`
    unless both carry a time zone, `since` is before `until`, it starts before now, within the last 10 years,
    and spans at most 62 days."""
    for name, t in (("since", since), ("until", until)):
        if t is not None and t.utcoffset() is None:
            raise Unprocessable(f"`{name}` must carry a time zone (e.g. Z)", code="invalid_window")
    try:
        end = until or now
        start = since or end - DEFAULT_WINDOW
    except OverflowError:  # a time at the edge of the calendar
        raise Unprocessable("the window is out of range", code="invalid_window") from None
    if start >= end:
        raise Unprocessable("`since` must be before `until`", code="invalid_window")
    if start >= now:
        raise Unprocessable("the window must start before now", code="invalid_window")
    if start < now - EARLIEST:
        raise Unprocessable("the window must start within the last 10 years", code="invalid_window")
    if end - start > MAX_WINDOW:
        raise Unprocessable(f"the window spans at most {MAX_WINDOW.days} days", code="invalid_window")
    return start, end


async def queue_history(
    session: AsyncSession,
    principal: Principal,
    *,
    tenant_id: uuid.UUID | None,
    gpu_model: str | None,
    since: datetime | None,
    until: datetime | None,
    points: int,
    now: datetime | None = None,
) -> QueueHistory:
    """Without `tenant_id`: every tenant's queue (operators, `allocations.queue.operate`). With it: that
    tenant's queue and its projects' (`allocations.queue.manage` on the tenant). A queue is listed when it has
    settings or held GPUs in the window; `gpu_model` keeps one pool."""
    if tenant_id is None:
        await iam.authorize(session, principal, "allocations.queue.operate")
    else:
        await iam.authorize(session, principal, "allocations.queue.manage", tenant_id=tenant_id)
    start, end = window(since, until, now or datetime.now(UTC))
    step = (end - start) / (points - 1)
    instants = [start + step * i for i in range(points)]

    admitted = (
        select(func.min(timeline.c.started_at))
        .where(
            timeline.c.allocation_id == allocations.c.allocation_id,
            timeline.c.phase == "queue",
            timeline.c.status == "succeeded",
        )
        .scalar_subquery()
    )
    starts = func.coalesce(admitted, allocations.c.requested_at).label("starts")
    held = exists().where(gpu_assignments.c.allocation_id == allocations.c.allocation_id)
    ends = case(
        (allocations.c.released_at.is_not(None), allocations.c.released_at),
        (and_(allocations.c.status == "failed", ~held), allocations.c.status_changed_at),
        else_=None,
    ).label("ends")
    q = select(
        allocations.c.tenant_id,
        allocations.c.project_id,
        allocations.c.gpu_model,
        allocations.c.gpu_count,
        starts,
        ends,
    ).where(
        allocations.c.host_id.is_not(None),  # placed at some point: a request that never got GPUs holds nothing
        allocations.c.requested_at <= end,
        or_(allocations.c.released_at.is_(None), allocations.c.released_at > start - step),
    )
    settings_q = select(capacity_queues)
    if tenant_id is not None:
        q = q.where(allocations.c.tenant_id == tenant_id)
        settings_q = settings_q.where(capacity_queues.c.tenant_id == tenant_id)
    else:
        settings_q = settings_q.where(capacity_queues.c.scope == "tenant")
    if gpu_model is not None:
        q = q.where(allocations.c.gpu_model == gpu_model)
        settings_q = settings_q.where(capacity_queues.c.gpu_model == gpu_model)
    rows = (await session.execute(q)).all()
    settings = {(r.scope, r.scope_id, r.gpu_model): r for r in (await session.execute(settings_q)).all()}

    # Each queue's holdings: an allocation counts for its tenant's queue and (for a tenant's view) its project's.
    holdings: dict[tuple[str, uuid.UUID, uuid.UUID, str], list[Holding]] = defaultdict(list)
    for r in rows:
        if r.starts is None or r.starts > end:  # admitted after the window (or its admission entry is gone)
            continue
        h = Holding(r.gpu_count, r.starts.timestamp(), r.ends.timestamp() if r.ends else None)
        holdings[("tenant", r.tenant_id, r.tenant_id, r.gpu_model)].append(h)
        if tenant_id is not None:
            holdings[("project", r.project_id, r.tenant_id, r.gpu_model)].append(h)
    for (scope, scope_id, model), s in settings.items():
        holdings.setdefault((scope, scope_id, s.tenant_id, model), [])

    out = []
    # By pool, the tenant first, then its projects.
    for scope, scope_id, tid, model in sorted(holdings, key=lambda k: (k[3], str(k[2]), k[0] != "tenant", str(k[1]))):
        hs = holdings[(scope, scope_id, tid, model)]
        series = []
        for t in instants:
            at = t.timestamp()
            now_held = sum(h.gpus for h in hs if h.start <= at and (h.end is None or h.end > at))
            peak, mean = window_use(hs, at - step.total_seconds(), at)
            series.append(SharePoint(at=t, held=now_held, peak=peak, mean=round(mean, 3)))
        s = settings.get((scope, scope_id, model))
        out.append(
            QueueShare(
                scope=scope,  # pyright: ignore[reportArgumentType]
                scope_id=scope_id,
                tenant_id=tid,
                gpu_model=model,
                guarantee=s.guarantee if s else 0,
                weight=s.weight if s else 1.0,
                points=series,
            )
        )
    return QueueHistory(since=start, until=end, queues=out)
