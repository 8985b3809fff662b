"""GPU-hours grouped by project and GPU model (issue 21): the console's GPU-hours charts. A read view over
the usage records (closed windows, what billing rates), so the hours shown are the hours charged; the
open part of a running meter (from `billed_until` on) is not in it yet."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal

from pydantic import BaseModel
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Unprocessable
from gpuaas.metering.models import usage_records
from gpuaas.metering.service.access import readable


class GpuHoursRow(BaseModel):
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    gpu_model: str
    gpu_hours: Decimal
    gpu_seconds: Decimal
    records: int


class GpuHours(BaseModel):
    since: datetime
    until: datetime
    # One row per project x GPU model with usage in [since, until) (by window start), biggest first.
    rows: list[GpuHoursRow]


def month_start(t: datetime) -> datetime:
    return t.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)


async def gpu_hours(
    session: AsyncSession,
    principal: Principal,
    *,
    project_id: uuid.UUID | None,
    since: datetime | None,
    until: datetime | None,
) -> GpuHours:
    """GPU-hours per project x GPU model of the projects the caller may read (or of one project), by the
    start of each recorded window; default: the current calendar month (UTC) up to now."""
    now = datetime.now(UTC)
    since = since or month_start(now)
    until = until or now
    if until <= since:
        raise Unprocessable("until must be after since", code="invalid_range")
    seconds = func.sum(usage_records.c.gpu_seconds)
    q = (
        select(
            usage_records.c.tenant_id,
            usage_records.c.project_id,
            usage_records.c.gpu_model,
            seconds,
            func.count(),
        )
        .where(usage_records.c.window_start >= since, usage_records.c.window_start < until)
        .group_by(usage_records.c.tenant_id, usage_records.c.project_id, usage_records.c.gpu_model)
        .order_by(seconds.desc(), usage_records.c.project_id, usage_records.c.gpu_model)
    )
    if (scope := await readable(session, principal, usage_records.c.project_id, project_id)) is not None:
        q = q.where(scope)
    rows = [
        GpuHoursRow(
            tenant_id=t,
            project_id=p,
            gpu_model=m,
            gpu_seconds=s,
            gpu_hours=(Decimal(s) / Decimal(3600)).quantize(Decimal("0.000001")),
            records=n,
        )
        for t, p, m, s, n in (await session.execute(q)).all()
    ]
    return GpuHours(since=since, until=until, rows=rows)
