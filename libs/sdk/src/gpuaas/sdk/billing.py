"""Billing: combined cost (GPU time + app usage) of a period."""

from __future__ import annotations

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
