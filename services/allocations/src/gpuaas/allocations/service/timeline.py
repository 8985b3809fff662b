"""The allocation timeline as read by the API (entries are written by the use cases, see common)."""

from __future__ import annotations

import uuid

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations.models import timeline
from gpuaas.allocations.service.common import load_allocation
from gpuaas.allocations.views import TimelineEntry
from gpuaas.kit.auth import Principal


async def read_timeline(
    session: AsyncSession, principal: Principal, alloc_id: uuid.UUID, after_seq: int = 0
) -> list[TimelineEntry]:
    """The allocation's entries after `after_seq`, if the principal may read it (else 404)."""
    await load_allocation(session, principal, alloc_id, "allocations.read")
    return await timeline_entries(session, alloc_id, after_seq)


async def timeline_entries(session: AsyncSession, alloc_id: uuid.UUID, after_seq: int = 0) -> list[TimelineEntry]:
    """Entries after `after_seq`, unchecked: for a reader already authorized (the live stream)."""
    rows = await session.execute(
        select(timeline)
        .where(timeline.c.allocation_id == alloc_id, timeline.c.seq > after_seq)
        .order_by(timeline.c.seq)
    )
    return [TimelineEntry.model_validate(r, from_attributes=True) for r in rows]
