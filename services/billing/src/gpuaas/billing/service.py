"""Billing use cases, each one transaction: ledger rows + rollups + outbox events (+ audit for API
mutations) commit together. Rating runs in the consumer's transaction with the inbox row, so a
redelivered usage event is a no-op; the ledger's unique usage_record_id makes a re-published record
(new event id, same record) a no-op too."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.billing import domain, rating
from gpuaas.billing.models import (
    budgets,
    charges,
    ledger_entries,
    ledger_transactions,
    periods,
    prices,
    statements,
    usage_received,
)
from gpuaas.contracts import Event, new_event_id
from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events import billing as bl
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, Unprocessable
from gpuaas.kit.logging import get_logger
from gpuaas.kit.outbox import add_events

SERVICE = "billing"
log = get_logger(__name__)


# ----------------------------------------------------------------------------------------- prices


async def publish_price(
    session: AsyncSession,
    principal: Principal,
    *,
    unit: bl.PriceUnit,
    unit_price: Decimal,
    currency: str,
    gpu_model: str | None,
    shape: CapacityShape | None,
    app_slug: str | None,
    effective_from: datetime,
    description: str,
) -> dict[str, Any]:
    """Publish a price: it supersedes the SKU's current price from `effective_from` and rates the
    SKU's waiting usage from then on. It may not be dated before usage already charged on the SKU
    (charges are never rewritten)."""
    await iam.authorize(session, principal, "billing.price.manage")
    if unit is bl.PriceUnit.gpu_hour:
        if not gpu_model or shape is None or app_slug:
            raise Unprocessable("a gpu_hour price needs gpu_model and shape (and no app_slug)", code="price_target")
        sku = domain.gpu_sku(gpu_model, str(shape))
    else:
        if not app_slug or gpu_model or shape is not None:
            raise Unprocessable("an app unit price needs app_slug (and no gpu_model/shape)", code="price_target")
        sku = domain.app_sku(app_slug, str(unit))
    await session.execute(select(func.pg_advisory_xact_lock(func.hashtext("price:" + sku))))
    current = (
        await session.execute(
            select(prices).where(prices.c.sku == sku).order_by(prices.c.effective_from.desc()).limit(1)
        )
    ).first()
    if current is not None and effective_from <= current.effective_from:
        raise Conflict(
            f"{sku} already has a price from {current.effective_from.isoformat()}; a new one must start later",
            code="price_not_after_current",
        )
    charged_after = (
        await session.execute(select(func.max(charges.c.usage_start)).where(charges.c.sku == sku))
    ).scalar_one()
    if charged_after is not None and effective_from <= charged_after:
        raise Conflict(
            f"usage of {sku} up to {charged_after.isoformat()} is already charged; the price must start later",
            code="price_would_rewrite_charges",
        )
    price_id = new_event_id()
    if current is not None:
        await session.execute(
            update(prices).where(prices.c.price_id == current.price_id).values(effective_to=effective_from)
        )
    values = {
        "price_id": price_id,
        "sku": sku,
        "description": description,
        "unit": str(unit),
        "unit_price": unit_price,
        "currency": currency,
        "gpu_model": gpu_model,
        "shape": str(shape) if shape else None,
        "app_slug": app_slug,
        "effective_from": effective_from,
        "effective_to": None,
        "created_by": str(principal.subject),
    }
    await session.execute(insert(prices).values(**values))
    state = bl.PriceState(**{k: v for k, v in values.items() if k != "created_by"})
    await add_events(session, [bl.PricePublished.build(data=state, source=SERVICE, actor=principal.actor)])
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="billing.price.publish",
        resource_type="price",
        resource_id=price_id,
        before=_price_json(current),
        after=state.model_dump(mode="json"),
    )
    # Rate what was waiting for this SKU and falls in the new price's range.
    price = (await session.execute(select(prices).where(prices.c.price_id == price_id))).one()
    waiting = (
        await session.execute(
            select(usage_received)
            .where(
                usage_received.c.sku == sku,
                usage_received.c.status == "unrated",
                usage_received.c.usage_start >= effective_from,
            )
            .with_for_update(skip_locked=True)
        )
    ).all()
    await rating.post_charges(session, [(dict(u._mapping), price) for u in waiting])
    return {**state.model_dump(), "rated_waiting_usage": len(waiting)}


def _price_json(row: Any) -> dict[str, Any] | None:
    if row is None:
        return None
    return {
        "price_id": str(row.price_id),
        "unit_price": str(row.unit_price),
        "currency": row.currency,
        "effective_from": row.effective_from.isoformat(),
    }


# ---------------------------------------------------------------------------------------- budgets


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
) -> dict[str, Any]:
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
    return dict(row._mapping)


# ------------------------------------------------------------------------------------- statements


async def close_statement(
    session: AsyncSession, principal: Principal, *, tenant_id: uuid.UUID, period_start: datetime
) -> list[dict[str, Any]]:
    """Close a tenant's ended period: one statement per currency, lines per project x SKU x app.
    Concurrent charges into the period finish first (FOR UPDATE on the period); later ones count in
    the period they are posted in."""
    await iam.authorize(session, principal, "billing.statement.close")
    period_start = domain.month_start(period_start)
    period_end = domain.next_month(period_start)
    if period_end > datetime.now(UTC):
        raise Unprocessable(f"the period ending {period_end.isoformat()} has not ended", code="period_not_ended")
    await session.execute(
        pg_insert(periods).values(tenant_id=tenant_id, period_start=period_start).on_conflict_do_nothing()
    )
    p = (
        await session.execute(
            select(periods)
            .where(periods.c.tenant_id == tenant_id, periods.c.period_start == period_start)
            .with_for_update()
        )
    ).one()
    if p.status == "closed":
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
    out: list[dict[str, Any]] = []
    events: list[Event] = []
    for currency, lines in by_currency.items():
        statement_id = new_event_id()
        state = bl.StatementState(
            statement_id=statement_id,
            tenant_id=tenant_id,
            period_start=period_start,
            period_end=period_end,
            currency=currency,
            total_amount=sum((Decimal(r.amount) for r in lines), Decimal(0)),
            lines=[
                bl.StatementLine(
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
        events.append(bl.StatementClosed.build(data=state, source=SERVICE, actor=principal.actor))
        out.append(state.model_dump())
    await add_events(session, events)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="billing.statement.close",
        resource_type="period",
        resource_id=f"{tenant_id}:{period_start.date().isoformat()}",
        tenant_id=tenant_id,
        after={"statements": [str(s["statement_id"]) for s in out], "period_start": period_start.isoformat()},
    )
    return out


# ------------------------------------------------------------------------------------------ views


async def ledger_balance(session: AsyncSession) -> dict[str, Any]:
    rows = (
        await session.execute(
            select(
                ledger_entries.c.currency,
                func.coalesce(func.sum(ledger_entries.c.amount).filter(ledger_entries.c.side == "debit"), 0),
                func.coalesce(func.sum(ledger_entries.c.amount).filter(ledger_entries.c.side == "credit"), 0),
                func.count(),
            ).group_by(ledger_entries.c.currency)
        )
    ).all()
    unbalanced = (
        await session.execute(
            select(func.count()).select_from(
                select(ledger_entries.c.transaction_id)
                .group_by(ledger_entries.c.transaction_id, ledger_entries.c.currency)
                .having(
                    func.sum(ledger_entries.c.amount).filter(ledger_entries.c.side == "debit")
                    != func.sum(ledger_entries.c.amount).filter(ledger_entries.c.side == "credit")
                )
                .subquery()
            )
        )
    ).scalar_one()
    transactions = (await session.execute(select(func.count()).select_from(ledger_transactions))).scalar_one()
    currencies = [{"currency": r[0], "debits": Decimal(r[1]), "credits": Decimal(r[2]), "entries": r[3]} for r in rows]
    return {
        "transactions": transactions,
        "currencies": currencies,
        "unbalanced_transactions": unbalanced,
        "balanced": unbalanced == 0 and all(c["debits"] == c["credits"] for c in currencies),
    }
