"""Billing's read-only series for charts (issue 21): spend per day of a period, with its budgets."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Query

from gpuaas.billing.api.schemas import BillingPeriod
from gpuaas.billing.service.daily import DailyCosts, daily_costs
from gpuaas.kit import iam
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal

router = APIRouter()


@router.get("/costs/daily", response_model=DailyCosts, tags=["costs"], openapi_extra=iam.action_doc("billing.read"))
async def costs_daily(
    kit: Kit,
    principal: CurrentPrincipal,
    tenant_id: uuid.UUID | None = None,
    project_id: uuid.UUID | None = None,
    period: BillingPeriod | None = Query(None, description="YYYY-MM; default the current period"),
) -> Any:
    """Spend per UTC day (the day the usage started) of a period, per currency, and the budgets of the
    scope. The days of a period add up to `GET /costs` of that period. Same scope rules as `/costs`."""
    async with kit.sessions() as session:
        return await daily_costs(session, principal, tenant_id=tenant_id, project_id=project_id, period=period)
