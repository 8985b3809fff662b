"""Statements: closing a tenant's ended period (one statement per currency) and reading them back."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.billing import SERVICE, domain
from gpuaas.billing.models import charges, periods, statements
from gpuaas.billing.service.periods import parse_period
from gpuaas.billing.service.views import Statement
from gpuaas.contracts import Event, new_event_id
from gpuaas.contracts.events import billing as billing_events
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound, Unprocessable
from gpuaas.kit.outbox import add_events


async def close_statement(
    session: AsyncSession, principal: Principal, *, tenant_id: uuid.UUID, period: str
) -> list[Statement]:
    """Close a tenant's ended period: one statement per currency, lines per project x SKU x app.
    Concurrent charges into the period finish first (FOR UPDATE on the period); later ones count in
    the period they are posted in."""
    period_start = parse_period(period)
    await iam.authorize(session, principal, "billing.statement.close")
    period_end = domain.next_month(period_start)
    if period_end > datetime.now(UTC):
        raise Unprocessable(f"the period ending {period_end.isoformat()} has not ended", code="period_not_ended")
    await session.execute(
        pg_insert(periods).values(tenant_id=tenant_id, period_start=period_start).on_conflict_do_nothing()
    )
    period_row = (
        await session.execute(
            select(periods)
            .where(periods.c.tenant_id == tenant_id, periods.c.period_start == period_start)
            .with_for_update()
        )
    ).one()
    if period_row.status == "closed":
        raise Conflict("this period's statement is already closed", code="statement_already_closed")
    closed_at = datetime.now(UTC)
    await session.execute(
        update(periods)
        .where(periods.c.tenant_id == tenant_id, periods.c.period_start == period_start)
        .values(status="closed", closed_at=closed_at)
    )
    rows = (
        await session.execute(
            select(
                charges.c.currency,
                charges.c.project_id,
                charges.c.sku,
                charges.c.app_slug,
                charges.c.unit,
                func.sum(charges.c.quantity).label("quantity"),
                func.sum(charges.c.amount).label("amount"),
            )
            .where(charges.c.tenant_id == tenant_id, charges.c.period_start == period_start)
            .group_by(charges.c.currency, charges.c.project_id, charges.c.sku, charges.c.app_slug, charges.c.unit)
            .order_by(charges.c.currency, charges.c.project_id, charges.c.sku)
        )
    ).all()
    by_currency: dict[str, list[Any]] = {}
    for r in rows:
        by_currency.setdefault(r.currency, []).append(r)
    out: list[Statement] = []
    events: list[Event] = []
    for currency, lines in by_currency.items():
        statement_id = new_event_id()
        state = billing_events.StatementState(
            statement_id=statement_id,
            tenant_id=tenant_id,
            period_start=period_start,
            period_end=period_end,
            currency=currency,
            total_amount=sum((Decimal(r.amount) for r in lines), Decimal(0)),
            lines=[
                billing_events.StatementLine(
                    project_id=r.project_id,
                    sku=r.sku,
                    app_slug=r.app_slug,
                    quantity=r.quantity,
                    unit=r.unit,
                    amount=r.amount,
                )
                for r in lines
            ],
            closed_at=closed_at,
        )
        doc = state.model_dump(mode="json")
        await session.execute(
            insert(statements).values(
                statement_id=statement_id,
                tenant_id=tenant_id,
                period_start=period_start,
                period_end=period_end,
                currency=currency,
                total_amount=state.total_amount,
                lines=doc["lines"],
                closed_at=closed_at,
            )
        )
        events.append(billing_events.StatementClosed.build(data=state, source=SERVICE, actor=principal.actor))
        # The lines as Python values (Decimals as computed), not the JSON-formatted copy stored above.
        lines = [line.model_dump() for line in state.lines]
        out.append(Statement(**state.model_dump(exclude={"lines"}), lines=lines))
    await add_events(session, events)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="billing.statement.close",
        resource_type="period",
        resource_id=f"{tenant_id}:{period_start.date().isoformat()}",
        tenant_id=tenant_id,
        after={"statements": [str(s.statement_id) for s in out], "period_start": period_start.isoformat()},
    )
    return out


async def list_statements(session: AsyncSession, principal: Principal, *, tenant_id: uuid.UUID) -> list[Statement]:
    """A tenant's statements, newest period first."""
    await iam.authorize(session, principal, "billing.read", tenant_id=tenant_id)
    rows = (
        await session.execute(
            select(statements).where(statements.c.tenant_id == tenant_id).order_by(statements.c.period_start.desc())
        )
    ).all()
    return [Statement.model_validate(r) for r in rows]


async def get_statement(session: AsyncSession, principal: Principal, statement_id: uuid.UUID) -> Statement:
    """One statement; another tenant's is answered like one that does not exist."""
    row = (await session.execute(select(statements).where(statements.c.statement_id == statement_id))).first()
    if row is None:
        raise NotFound("no such statement", code="statement_not_found")
    await iam.authorize(session, principal, "billing.read", tenant_id=row.tenant_id)
    return Statement.model_validate(row)
