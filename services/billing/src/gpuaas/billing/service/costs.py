"""Cost views: a tenant's (or project's) period cost, the operators' breakdown, and the charges list."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.billing import domain
from gpuaas.billing.models import charges, spend
from gpuaas.billing.service.periods import parse_period
from gpuaas.billing.service.views import BreakdownRow, Charge, Costs, CurrencyTotal, ProjectCost
from gpuaas.kit import iam, paging
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import NotFound, Unprocessable


async def cost_scope(
    session: AsyncSession,
    principal: Principal,
    *,
    tenant_id: uuid.UUID | None,
    project_id: uuid.UUID | None,
    period: str | None,
) -> tuple[uuid.UUID, datetime]:
    """The scope rules of every cost view: a tenant or a project (`billing.read` there), the project's tenant
    when asked by project, and the period's start (default the current period)."""
    if tenant_id is None and project_id is None:
        raise Unprocessable("give tenant_id or project_id", code="scope_required")
    start = parse_period(period)
    await iam.authorize(session, principal, "billing.read", tenant_id=tenant_id, project_id=project_id)
    if tenant_id is None:  # asked by project (authorized above, so it exists and has a tenant)
        assert project_id is not None  # one of the two is given (checked above)
        tenant_id = await iam.project_tenant(session, project_id)
        if tenant_id is None:  # archived since it was authorized
            raise NotFound("project not found", code="not_found")
    return tenant_id, start


async def costs(
    session: AsyncSession,
    principal: Principal,
    *,
    tenant_id: uuid.UUID | None,
    project_id: uuid.UUID | None,
    period: str | None,
) -> Costs:
    """Combined cost (GPU time + app usage) of a tenant for a period, split per project, with totals
    per currency. Tenant admins ask by tenant; project admins by project (theirs only)."""
    tenant_id, start = await cost_scope(session, principal, tenant_id=tenant_id, project_id=project_id, period=period)
    q = (
        select(spend.c.project_id, spend.c.currency, func.sum(spend.c.gpu_amount), func.sum(spend.c.app_amount))
        .where(spend.c.tenant_id == tenant_id, spend.c.period_start == start)
        .group_by(spend.c.project_id, spend.c.currency)
        .order_by(spend.c.project_id, spend.c.currency)
    )
    if project_id is not None:
        q = q.where(spend.c.project_id == project_id)
    projects = [
        ProjectCost(project_id=p, currency=c, gpu_amount=gpu, app_amount=app, amount=gpu + app)
        for p, c, gpu, app in (await session.execute(q)).all()
    ]
    totals: dict[str, CurrencyTotal] = {}
    for p in projects:
        t = totals.setdefault(
            p.currency,
            CurrencyTotal(currency=p.currency, gpu_amount=Decimal(0), app_amount=Decimal(0), amount=Decimal(0)),
        )
        t.gpu_amount += p.gpu_amount
        t.app_amount += p.app_amount
        t.amount += p.amount
    return Costs(
        tenant_id=tenant_id,
        period_start=start,
        period_end=domain.next_month(start),
        totals=list(totals.values()),
        projects=projects,
    )


async def breakdown(
    session: AsyncSession, principal: Principal, *, period: str | None, tenant_id: uuid.UUID | None
) -> list[BreakdownRow]:
    """Operators: cost per tenant x project x SKU x app for a period."""
    start = parse_period(period)
    await iam.authorize(session, principal, "billing.breakdown.read")
    keys = (
        charges.c.tenant_id,
        charges.c.project_id,
        charges.c.sku,
        charges.c.app_slug,
        charges.c.unit,
        charges.c.currency,
    )
    q = (
        select(
            *keys,
            func.sum(charges.c.quantity).label("quantity"),
            func.sum(charges.c.amount).label("amount"),
            func.count().label("charges"),
        )
        .where(charges.c.period_start == start)
        .group_by(*keys)
        .order_by(charges.c.tenant_id, charges.c.project_id, charges.c.sku)
    )
    if tenant_id is not None:
        q = q.where(charges.c.tenant_id == tenant_id)
    return [BreakdownRow.model_validate(r) for r in (await session.execute(q)).all()]


async def list_charges(
    session: AsyncSession,
    principal: Principal,
    *,
    project_id: uuid.UUID,
    allocation_id: uuid.UUID | None,
    instance_id: uuid.UUID | None,
    page: paging.PageRequest,
) -> tuple[list[Charge], str | None]:
    """A project's charges, newest usage first (optionally of one allocation or app instance): one page
    (keyset on usage_start, charge_id) and the next page's cursor (None on the last)."""
    await iam.authorize(session, principal, "billing.read", project_id=project_id)
    q = select(charges).where(charges.c.project_id == project_id)
    if allocation_id is not None:
        q = q.where(charges.c.allocation_id == allocation_id)
    if instance_id is not None:
        q = q.where(charges.c.instance_id == instance_id)
    q = paging.keyset(q, [charges.c.usage_start, charges.c.charge_id], page)
    rows, next_cursor = paging.split((await session.execute(q)).all(), page, lambda r: (r.usage_start, r.charge_id))
    return [Charge.model_validate(r) for r in rows], next_cursor
