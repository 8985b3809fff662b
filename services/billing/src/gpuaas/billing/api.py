"""Billing's HTTP surface: price book, cost views, operator breakdown, budgets, statements, ledger check."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import AwareDatetime, BaseModel, Field
from sqlalchemy import func, select

from gpuaas.billing import domain, rating, service
from gpuaas.billing.models import budget_alerts, budgets, charges, prices, spend, statements
from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events.billing import PriceUnit
from gpuaas.kit import iam
from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.kit.errors import NotFound, Unprocessable

router = APIRouter()
CURRENCY = r"^[A-Z]{3}$"
PERIOD = r"^\d{4}-(0[1-9]|1[0-2])$"


class PriceCreate(BaseModel):
    unit: PriceUnit
    unit_price: Decimal = Field(ge=0, max_digits=24, decimal_places=9, allow_inf_nan=False)
    currency: str = Field(pattern=CURRENCY)
    gpu_model: str | None = Field(None, min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._-]+$")
    shape: CapacityShape | None = None
    app_slug: str | None = Field(None, min_length=1, max_length=100, pattern=r"^[a-z0-9][a-z0-9-]*$")
    effective_from: AwareDatetime | None = None
    description: str = Field("", max_length=500)


class Price(BaseModel):
    price_id: uuid.UUID
    sku: str
    description: str
    unit: PriceUnit
    unit_price: Decimal
    currency: str
    gpu_model: str | None
    shape: str | None
    app_slug: str | None
    effective_from: datetime
    effective_to: datetime | None
    rated_waiting_usage: int | None = None


class BudgetCreate(BaseModel):
    tenant_id: uuid.UUID
    project_id: uuid.UUID | None = None
    name: str = Field("", max_length=200)
    limit_amount: Decimal = Field(gt=0, max_digits=24, decimal_places=6, allow_inf_nan=False)
    currency: str = Field(pattern=CURRENCY)
    thresholds: list[Annotated[int, Field(ge=1, le=1000)]] = Field(
        default_factory=lambda: [50, 80, 100], min_length=1, max_length=10
    )


class Budget(BaseModel):
    budget_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID | None
    name: str
    limit_amount: Decimal
    currency: str
    thresholds: list[int]
    created_at: datetime


class BudgetStatus(Budget):
    period_start: datetime
    spent_amount: Decimal
    alerts: list[dict[str, Any]]


class StatementClose(BaseModel):
    tenant_id: uuid.UUID
    period: str = Field(pattern=PERIOD, description="YYYY-MM (UTC calendar month)")


class ProjectCost(BaseModel):
    project_id: uuid.UUID
    currency: str
    gpu_amount: Decimal
    app_amount: Decimal
    amount: Decimal


class CurrencyTotal(BaseModel):
    currency: str
    gpu_amount: Decimal
    app_amount: Decimal
    amount: Decimal


class Costs(BaseModel):
    tenant_id: uuid.UUID
    period_start: datetime
    period_end: datetime
    totals: list[CurrencyTotal]
    projects: list[ProjectCost]


class BreakdownRow(BaseModel):
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    sku: str
    app_slug: str | None
    unit: str
    currency: str
    quantity: Decimal
    amount: Decimal
    charges: int


class Charge(BaseModel):
    charge_id: uuid.UUID
    usage_record_id: uuid.UUID
    usage_kind: str
    project_id: uuid.UUID
    sku: str
    quantity: Decimal
    unit: str
    unit_price: Decimal
    amount: Decimal
    currency: str
    allocation_id: uuid.UUID | None
    instance_id: uuid.UUID | None
    app_slug: str | None
    usage_start: datetime
    usage_end: datetime
    period_start: datetime
    posted_at: datetime


class LedgerBalance(BaseModel):
    transactions: int
    currencies: list[dict[str, Any]]
    unbalanced_transactions: int
    balanced: bool


def _kit(request: Request) -> Any:
    return request.app.state.kit


def _period(period: str | None) -> datetime:
    if period is None:
        return domain.month_start(datetime.now(UTC))
    year, month = period.split("-")
    try:
        return datetime(int(year), int(month), 1, tzinfo=UTC)
    except ValueError:  # e.g. year 0000: matches PERIOD but is no calendar month
        raise Unprocessable(f"{period!r} is not a calendar month", code="invalid_period") from None


# ------------------------------------------------------------------------------------------ prices


@router.post(
    "/prices",
    response_model=Price,
    status_code=201,
    tags=["prices"],
    openapi_extra=iam.action_doc("billing.price.manage"),
)
async def create_price(body: PriceCreate, request: Request, principal: CurrentPrincipal) -> Any:
    """Publish a price (operators). GPU time: `unit=gpu_hour` with `gpu_model` and `shape`; app usage:
    `unit` tokens/requests/model_seconds with `app_slug`. Waiting (unrated) usage is rated at once."""
    async with _kit(request).sessions() as session, session.begin():
        return await service.publish_price(
            session,
            principal,
            unit=body.unit,
            unit_price=body.unit_price,
            currency=body.currency,
            gpu_model=body.gpu_model,
            shape=body.shape,
            app_slug=body.app_slug,
            effective_from=(body.effective_from or datetime.now(UTC)).astimezone(UTC),
            description=body.description,
        )


@router.get("/prices", response_model=list[Price], tags=["prices"])
async def list_prices(
    request: Request, principal: CurrentPrincipal, sku: str | None = None, current: bool = False
) -> Any:
    """The price book (every authenticated caller may read it)."""
    async with _kit(request).sessions() as session:
        q = select(prices).order_by(prices.c.sku, prices.c.effective_from)
        if sku:
            q = q.where(prices.c.sku == sku)
        if current:
            q = q.where(prices.c.effective_to.is_(None))
        return [r._mapping for r in (await session.execute(q)).all()]


# ------------------------------------------------------------------------------------------- costs


@router.get("/costs", response_model=Costs, tags=["costs"], openapi_extra=iam.action_doc("billing.read"))
async def costs(
    request: Request,
    principal: CurrentPrincipal,
    tenant_id: uuid.UUID | None = None,
    project_id: uuid.UUID | None = None,
    period: str | None = Query(None, pattern=PERIOD, description="YYYY-MM; default the current period"),
) -> Any:
    """Combined cost (GPU time + app usage) of a tenant for a period, split per project. Tenant admins
    ask by `tenant_id`; project admins by `project_id` (their project only)."""
    if tenant_id is None and project_id is None:
        raise Unprocessable("give tenant_id or project_id", code="scope_required")
    start = _period(period)
    async with _kit(request).sessions() as session:
        await iam.authorize(session, principal, "billing.read", tenant_id=tenant_id, project_id=project_id)
        if tenant_id is None:
            tenant_id = await iam.project_tenant(session, project_id)  # type: ignore[arg-type]
        q = (
            select(spend.c.project_id, spend.c.currency, func.sum(spend.c.gpu_amount), func.sum(spend.c.app_amount))
            .where(spend.c.tenant_id == tenant_id, spend.c.period_start == start)
            .group_by(spend.c.project_id, spend.c.currency)
            .order_by(spend.c.project_id, spend.c.currency)
        )
        if project_id is not None:
            q = q.where(spend.c.project_id == project_id)
        rows = (await session.execute(q)).all()
    projects = [
        ProjectCost(project_id=r[0], currency=r[1], gpu_amount=r[2], app_amount=r[3], amount=r[2] + r[3]) for r in rows
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


@router.get(
    "/costs/breakdown",
    response_model=list[BreakdownRow],
    tags=["costs"],
    openapi_extra=iam.action_doc("billing.breakdown.read"),
)
async def breakdown(
    request: Request,
    principal: CurrentPrincipal,
    period: str | None = Query(None, pattern=PERIOD),
    tenant_id: uuid.UUID | None = None,
) -> Any:
    """Operators: cost per tenant x project x SKU x app for a period."""
    start = _period(period)
    async with _kit(request).sessions() as session:
        await iam.authorize(session, principal, "billing.breakdown.read")
        q = (
            select(
                charges.c.tenant_id,
                charges.c.project_id,
                charges.c.sku,
                charges.c.app_slug,
                charges.c.unit,
                charges.c.currency,
                func.sum(charges.c.quantity),
                func.sum(charges.c.amount),
                func.count(),
            )
            .where(charges.c.period_start == start)
            .group_by(
                charges.c.tenant_id,
                charges.c.project_id,
                charges.c.sku,
                charges.c.app_slug,
                charges.c.unit,
                charges.c.currency,
            )
            .order_by(charges.c.tenant_id, charges.c.project_id, charges.c.sku)
        )
        if tenant_id is not None:
            q = q.where(charges.c.tenant_id == tenant_id)
        rows = (await session.execute(q)).all()
    return [
        BreakdownRow(
            tenant_id=r[0],
            project_id=r[1],
            sku=r[2],
            app_slug=r[3],
            unit=r[4],
            currency=r[5],
            quantity=r[6],
            amount=r[7],
            charges=r[8],
        )
        for r in rows
    ]


@router.get("/charges", response_model=list[Charge], tags=["costs"], openapi_extra=iam.action_doc("billing.read"))
async def list_charges(
    request: Request,
    principal: CurrentPrincipal,
    project_id: uuid.UUID,
    allocation_id: uuid.UUID | None = None,
    instance_id: uuid.UUID | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Any:
    async with _kit(request).sessions() as session:
        await iam.authorize(session, principal, "billing.read", project_id=project_id)
        q = (
            select(charges)
            .where(charges.c.project_id == project_id)
            .order_by(charges.c.usage_start.desc())
            .limit(limit)
        )
        if allocation_id is not None:
            q = q.where(charges.c.allocation_id == allocation_id)
        if instance_id is not None:
            q = q.where(charges.c.instance_id == instance_id)
        return [r._mapping for r in (await session.execute(q)).all()]


@router.get(
    "/ledger/balance", response_model=LedgerBalance, tags=["ledger"], openapi_extra=iam.action_doc("platform.admin")
)
async def ledger_balance(request: Request, principal: CurrentPrincipal) -> Any:
    """Operators: sum of debits and credits per currency; `balanced` must always be true."""
    async with _kit(request).sessions() as session:
        await iam.authorize(session, principal, "platform.admin")
        return await service.ledger_balance(session)


# ----------------------------------------------------------------------------------------- budgets


@router.post(
    "/budgets",
    response_model=Budget,
    status_code=201,
    tags=["budgets"],
    openapi_extra=iam.action_doc("billing.budget.manage"),
)
async def create_budget(body: BudgetCreate, request: Request, principal: CurrentPrincipal) -> Any:
    """A monthly budget for a tenant (or one project); `budget.threshold_crossed` is emitted once per
    threshold and period when spend reaches it."""
    async with _kit(request).sessions() as session, session.begin():
        return await service.create_budget(
            session,
            principal,
            tenant_id=body.tenant_id,
            project_id=body.project_id,
            name=body.name,
            limit_amount=body.limit_amount,
            currency=body.currency,
            thresholds=body.thresholds,
        )


@router.get(
    "/budgets", response_model=list[BudgetStatus], tags=["budgets"], openapi_extra=iam.action_doc("billing.read")
)
async def list_budgets(
    request: Request,
    principal: CurrentPrincipal,
    tenant_id: uuid.UUID,
    period: str | None = Query(None, pattern=PERIOD),
) -> Any:
    start = _period(period)
    async with _kit(request).sessions() as session:
        await iam.authorize(session, principal, "billing.read", tenant_id=tenant_id)
        rows = (
            await session.execute(
                select(budgets).where(budgets.c.tenant_id == tenant_id).order_by(budgets.c.created_at)
            )
        ).all()
        out = []
        for b in rows:
            spent = await rating.spent(session, tenant_id, b.project_id, start, b.currency)
            alerts = (
                await session.execute(
                    select(budget_alerts.c.threshold_percent, budget_alerts.c.spent_amount, budget_alerts.c.crossed_at)
                    .where(budget_alerts.c.budget_id == b.budget_id, budget_alerts.c.period_start == start)
                    .order_by(budget_alerts.c.threshold_percent)
                )
            ).all()
            out.append(
                {
                    **b._mapping,
                    "period_start": start,
                    "spent_amount": spent,
                    "alerts": [dict(a._mapping) for a in alerts],
                }
            )
        return out


# -------------------------------------------------------------------------------------- statements


@router.post(
    "/statements/close", status_code=201, tags=["statements"], openapi_extra=iam.action_doc("billing.statement.close")
)
async def close_statement(body: StatementClose, request: Request, principal: CurrentPrincipal) -> Any:
    """Operators: close a tenant's ended period into statements (one per currency)."""
    async with _kit(request).sessions() as session, session.begin():
        return await service.close_statement(
            session, principal, tenant_id=body.tenant_id, period_start=_period(body.period)
        )


@router.get("/statements", tags=["statements"], openapi_extra=iam.action_doc("billing.read"))
async def list_statements(request: Request, principal: CurrentPrincipal, tenant_id: uuid.UUID) -> Any:
    async with _kit(request).sessions() as session:
        await iam.authorize(session, principal, "billing.read", tenant_id=tenant_id)
        rows = (
            await session.execute(
                select(statements).where(statements.c.tenant_id == tenant_id).order_by(statements.c.period_start.desc())
            )
        ).all()
        return [dict(r._mapping) for r in rows]


@router.get("/statements/{statement_id}", tags=["statements"], openapi_extra=iam.action_doc("billing.read"))
async def get_statement(statement_id: uuid.UUID, request: Request, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session:
        row = (await session.execute(select(statements).where(statements.c.statement_id == statement_id))).first()
        if row is None:
            raise NotFound("no such statement", code="statement_not_found")
        await iam.authorize(session, principal, "billing.read", tenant_id=row.tenant_id)
        return dict(row._mapping)
