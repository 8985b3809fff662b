"""Billing for operators: publishing prices, the cost breakdown, the ledger check, closing statements."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Query

from gpuaas.billing import service
from gpuaas.billing.api.schemas import BillingPeriod, BreakdownRow, LedgerBalance, Price, PriceCreate, StatementClose
from gpuaas.kit import iam
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal

router = APIRouter()


@router.post(
    "/prices",
    response_model=Price,
    status_code=201,
    tags=["prices"],
    openapi_extra=iam.action_doc("billing.price.manage"),
)
async def create_price(body: PriceCreate, kit: Kit, principal: CurrentPrincipal) -> Any:
    """Publish a price (operators). GPU time: `unit=gpu_hour` with `gpu_model` and `shape`; app usage:
    `unit` tokens/requests/model_seconds with `app_slug`. Waiting (unrated) usage is rated at once."""
    async with kit.sessions() as session, session.begin():
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


@router.get(
    "/costs/breakdown",
    response_model=list[BreakdownRow],
    tags=["costs"],
    openapi_extra=iam.action_doc("billing.breakdown.read"),
)
async def breakdown(
    kit: Kit,
    principal: CurrentPrincipal,
    period: BillingPeriod | None = Query(None),
    tenant_id: uuid.UUID | None = None,
) -> Any:
    """Operators: cost per tenant x project x SKU x app for a period."""
    async with kit.sessions() as session:
        return await service.breakdown(session, principal, period=period, tenant_id=tenant_id)


@router.get(
    "/ledger/balance", response_model=LedgerBalance, tags=["ledger"], openapi_extra=iam.action_doc("platform.admin")
)
async def ledger_balance(kit: Kit, principal: CurrentPrincipal) -> Any:
    """Operators: sum of debits and credits per currency; `balanced` must always be true."""
    async with kit.sessions() as session:
        return await service.ledger_balance(session, principal)


@router.post(
    "/statements/close", status_code=201, tags=["statements"], openapi_extra=iam.action_doc("billing.statement.close")
)
async def close_statement(body: StatementClose, kit: Kit, principal: CurrentPrincipal) -> Any:
    """Operators: close a tenant's ended period into statements (one per currency)."""
    async with kit.sessions() as session, session.begin():
        return await service.close_statement(session, principal, tenant_id=body.tenant_id, period=body.period)
