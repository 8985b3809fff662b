"""The daily spend series (issue 21): what a tenant (or one project) was charged each day of a billing
period, per currency, with the budgets that apply to it, for the console's spend chart and `gpuaas cost
--by day`. A read view over the ledger's charges: a charge counts on the UTC day its usage started, and the
period is the charge's billing period, so the days of a period add up to exactly what `GET /costs` says."""

from __future__ import annotations

import uuid
from datetime import date, datetime
from decimal import Decimal

from pydantic import BaseModel
from sqlalchemy import Date, case, cast, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.billing import domain
from gpuaas.billing.models import budgets, charges
from gpuaas.billing.service.costs import cost_scope
from gpuaas.kit.auth import Principal


class DaySpend(BaseModel):
    day: date
    currency: str
    gpu_amount: Decimal
    app_amount: Decimal
    amount: Decimal


class BudgetLine(BaseModel):
    budget_id: uuid.UUID
    name: str
    project_id: uuid.UUID | None
    limit_amount: Decimal
    currency: str


class DailyCosts(BaseModel):
    tenant_id: uuid.UUID
    project_id: uuid.UUID | None
    period_start: datetime
    period_end: datetime
    # Only the days with charges, oldest first; a day with charges in two currencies has two rows.
    days: list[DaySpend]
    # The monthly budgets of this scope: the tenant's (all of them) or, asked by project, that project's.
    budgets: list[BudgetLine]


async def daily_costs(
    session: AsyncSession,
    principal: Principal,
    *,
    tenant_id: uuid.UUID | None,
    project_id: uuid.UUID | None,
    period: str | None,
) -> DailyCosts:
    """Spend per UTC day of one period (default the current one); same scope rules as `costs`."""
    tenant_id, start = await cost_scope(session, principal, tenant_id=tenant_id, project_id=project_id, period=period)
    day = cast(func.timezone("UTC", charges.c.usage_start), Date).label("day")
    gpu = func.sum(case((charges.c.usage_kind == "gpu", charges.c.amount), else_=0))
    app = func.sum(case((charges.c.usage_kind == "gpu", 0), else_=charges.c.amount))
    q = (
        select(day, charges.c.currency, gpu, app)
        .where(charges.c.tenant_id == tenant_id, charges.c.period_start == start)
        .group_by(day, charges.c.currency)
        .order_by(day, charges.c.currency)
    )
    b = select(budgets).where(budgets.c.tenant_id == tenant_id).order_by(budgets.c.created_at)
    if project_id is not None:
        q = q.where(charges.c.project_id == project_id)
        b = b.where(budgets.c.project_id == project_id)
    days = [
        DaySpend(day=d, currency=c, gpu_amount=g, app_amount=a, amount=g + a)
        for d, c, g, a in (await session.execute(q)).all()
    ]
    lines = [
        BudgetLine(
            budget_id=r.budget_id,
            name=r.name,
            project_id=r.project_id,
            limit_amount=r.limit_amount,
            currency=r.currency,
        )
        for r in (await session.execute(b)).all()
    ]
    return DailyCosts(
        tenant_id=tenant_id,
        project_id=project_id,
        period_start=start,
        period_end=domain.next_month(start),
        days=days,
        budgets=lines,
    )
