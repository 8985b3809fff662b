"""Billing for tenants and projects (and any signed-in caller for the price book): costs, charges,
budgets and statements, each scoped by the use case's authorization."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response

from gpuaas.billing import service
from gpuaas.billing.api.schemas import BillingPeriod, Budget, BudgetCreate, BudgetStatus, Charge, Costs, Price
from gpuaas.kit import iam
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.kit.paging import PageRequest, page_params, set_next_link

router = APIRouter()


@router.get("/prices", response_model=list[Price], tags=["prices"])
async def list_prices(kit: Kit, principal: CurrentPrincipal, sku: str | None = None, current: bool = False) -> Any:
    """The price book (every authenticated caller may read it)."""
    async with kit.sessions() as session:
        return await service.list_prices(session, sku=sku, current=current)


@router.get("/costs", response_model=Costs, tags=["costs"], openapi_extra=iam.action_doc("billing.read"))
async def costs(
    kit: Kit,
    principal: CurrentPrincipal,
    tenant_id: uuid.UUID | None = None,
    project_id: uuid.UUID | None = None,
    period: BillingPeriod | None = Query(None, description="YYYY-MM; default the current period"),
) -> Any:
    """Combined cost (GPU time + app usage) of a tenant for a period, split per project. Tenant admins
    ask by `tenant_id`; project admins by `project_id` (their project only)."""
    async with kit.sessions() as session:
        return await service.costs(session, principal, tenant_id=tenant_id, project_id=project_id, period=period)


_CHARGE_PAGE = Depends(page_params(default=100, maximum=1000))


@router.get("/charges", response_model=list[Charge], tags=["costs"], openapi_extra=iam.action_doc("billing.read"))
async def list_charges(
    kit: Kit,
    request: Request,
    response: Response,
    principal: CurrentPrincipal,
    project_id: uuid.UUID,
    allocation_id: uuid.UUID | None = None,
    instance_id: uuid.UUID | None = None,
    page: PageRequest = _CHARGE_PAGE,
) -> Any:
    """Newest usage first; `?limit=&cursor=` pages (`Link: <...>; rel="next"` while more follow)."""
    async with kit.sessions() as session:
        items, next_cursor = await service.list_charges(
            session, principal, project_id=project_id, allocation_id=allocation_id, instance_id=instance_id, page=page
        )
    set_next_link(request, response, next_cursor)
    return items


@router.post(
    "/budgets",
    response_model=Budget,
    status_code=201,
    tags=["budgets"],
    openapi_extra=iam.action_doc("billing.budget.manage"),
)
async def create_budget(body: BudgetCreate, kit: Kit, principal: CurrentPrincipal) -> Any:
    """A monthly budget for a tenant (or one project); `budget.threshold_crossed` is emitted once per
    threshold and period when spend reaches it."""
    async with kit.sessions() as session, session.begin():
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
    kit: Kit,
    principal: CurrentPrincipal,
    tenant_id: uuid.UUID,
    period: BillingPeriod | None = Query(None),
) -> Any:
    async with kit.sessions() as session:
        return await service.budget_statuses(session, principal, tenant_id=tenant_id, period=period)


@router.get("/statements", tags=["statements"], openapi_extra=iam.action_doc("billing.read"))
async def list_statements(kit: Kit, principal: CurrentPrincipal, tenant_id: uuid.UUID) -> Any:
    async with kit.sessions() as session:
        return await service.list_statements(session, principal, tenant_id=tenant_id)


@router.get("/statements/{statement_id}", tags=["statements"], openapi_extra=iam.action_doc("billing.read"))
async def get_statement(statement_id: uuid.UUID, kit: Kit, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session:
        return await service.get_statement(session, principal, statement_id)
