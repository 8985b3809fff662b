"""The allocation timeline as read by the API (entries are written by the use cases, see common)."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations.models import timeline


async def timeline_entries(session: AsyncSession, alloc_id: uuid.UUID, after_seq: int = 0) -> list[dict[str, Any]]:
    rows = await session.execute(
        select(timeline)
        .where(timeline.c.allocation_id == alloc_id, timeline.c.seq > after_seq)
        .order_by(timeline.c.seq)
    )
    return [dict(r._mapping) for r in rows]
