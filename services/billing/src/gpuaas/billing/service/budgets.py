"""Budgets: a monthly limit per tenant (or project) with alert thresholds, and their status per period."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.billing import SERVICE, domain
from gpuaas.billing.models import budget_alerts, budgets
from gpuaas.billing.service import rating
from gpuaas.billing.service.periods import parse_period
from gpuaas.billing.service.views import Budget, BudgetAlert, BudgetStatus
from gpuaas.contracts import new_event_id
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.outbox import add_events


async def create_budget(
    session: AsyncSession,
    principal: Principal,
    *,
    tenant_id: uuid.UUID,
    project_id: uuid.UUID | None,
    name: str,
    limit_amount: Decimal,
    currency: str,
    thresholds: list[int],
) -> Budget:
    await iam.authorize(session, principal, "billing.budget.manage", tenant_id=tenant_id, project_id=project_id)
    budget_id = new_event_id()
    values = {
        "budget_id": budget_id,
        "tenant_id": tenant_id,
        "project_id": project_id,
        "name": name,
        "limit_amount": limit_amount,
        "currency": currency,
        "thresholds": sorted(set(thresholds)),
        "created_by": str(principal.subject),
    }
    row = (await session.execute(insert(budgets).values(**values).returning(budgets))).one()
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="billing.budget.create",
        resource_type="budget",
        resource_id=budget_id,
        tenant_id=tenant_id,
        project_id=project_id,
        after={
            **values,
            "budget_id": str(budget_id),
            "tenant_id": str(tenant_id),
            "project_id": str(project_id) if project_id else None,
            "limit_amount": str(limit_amount),
        },
    )
    # Spend already in this period may have crossed thresholds: alert now rather than at the next charge.
    period = domain.month_start(datetime.now(UTC))
    events = await rating.alerts_for(session, row, period)
    await add_events(session, events)
    return Budget.model_validate(row)


async def budget_statuses(
    session: AsyncSession, principal: Principal, *, tenant_id: uuid.UUID, period: str | None
) -> list[BudgetStatus]:
    """A tenant's budgets (oldest first), each with its spend and alerts in the period."""
    start = parse_period(period)
    await iam.authorize(session, principal, "billing.read", tenant_id=tenant_id)
    rows = (
        await session.execute(select(budgets).where(budgets.c.tenant_id == tenant_id).order_by(budgets.c.created_at))
    ).all()
    out = []
    for row in rows:
        budget = Budget.model_validate(row)
        spent = await rating.spent(session, tenant_id, budget.project_id, start, budget.currency)
        alerts = (
            await session.execute(
                select(budget_alerts.c.threshold_percent, budget_alerts.c.spent_amount, budget_alerts.c.crossed_at)
                .where(budget_alerts.c.budget_id == budget.budget_id, budget_alerts.c.period_start == start)
                .order_by(budget_alerts.c.threshold_percent)
            )
        ).all()
        out.append(
            BudgetStatus(
                **budget.model_dump(),
                period_start=start,
                spent_amount=spent,
                alerts=[BudgetAlert.model_validate(a) for a in alerts],
            )
        )
    return out
