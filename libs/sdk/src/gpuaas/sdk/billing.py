"""Billing: combined cost (GPU time + app usage) of a period, and its daily series."""

from __future__ import annotations

from typing import Any

from gpuaas.sdk.models import Costs
from gpuaas.sdk.transport import Id, Transport, query

BILLING = "/api/billing"


class BillingApi(Transport):
    async def costs(
        self, *, project_id: Id | None = None, tenant_id: Id | None = None, period: str | None = None
    ) -> Costs:
        """One project's cost, or (tenant admins) the whole tenant's; `period` is YYYY-MM, else the current one."""
        params = query({"tenant_id": tenant_id, "project_id": project_id, "period": period})
        return Costs.model_validate(await self.request("GET", f"{BILLING}/costs", params=params))

    async def daily_costs(
        self, *, project_id: Id | None = None, tenant_id: Id | None = None, period: str | None = None
    ) -> dict[str, Any]:
        """Spend per UTC day of a period (`days`: day, currency, gpu_amount, app_amount, amount) and the budgets of
        the scope (`budgets`); the days add up to `costs()` of the same period."""
        params = query({"tenant_id": tenant_id, "project_id": project_id, "period": period})
        data: dict[str, Any] = await self.request("GET", f"{BILLING}/costs/daily", params=params)
        return data
