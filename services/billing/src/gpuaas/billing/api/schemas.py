"""Billing's request and response bodies. The responses are the use cases' views (service/views.py), so
what a use case answers and what the API shows cannot drift apart."""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Annotated

from pydantic import AwareDatetime, BaseModel, Field

from gpuaas.billing.service.views import (
    BreakdownRow,
    Budget,
    BudgetAlert,
    BudgetStatus,
    Charge,
    Costs,
    CurrencyBalance,
    CurrencyTotal,
    LedgerBalance,
    Price,
    ProjectCost,
    Statement,
)
from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events.billing import PriceUnit
from gpuaas.contracts.scalars import PERIOD_PATTERN, BillingPeriod, CurrencyCode, Integer, Name, Text

CURRENCY = r"^[A-Z]{3}$"
PERIOD = PERIOD_PATTERN


class PriceCreate(BaseModel):
    unit: PriceUnit
    unit_price: Decimal = Field(ge=0, max_digits=24, decimal_places=9, allow_inf_nan=False)
    currency: CurrencyCode
    gpu_model: str | None = Field(None, min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._-]+$")
    shape: CapacityShape | None = None
    app_slug: str | None = Field(None, min_length=1, max_length=100, pattern=r"^[a-z0-9][a-z0-9-]*$")
    effective_from: AwareDatetime | None = None
    description: Text = Field("", max_length=500)


class BudgetCreate(BaseModel):
    tenant_id: uuid.UUID
    project_id: uuid.UUID | None = None
    name: Name = Field("", max_length=200)
    limit_amount: Decimal = Field(gt=0, max_digits=24, decimal_places=6, allow_inf_nan=False)
    currency: CurrencyCode
    thresholds: list[Annotated[Integer, Field(ge=1, le=1000)]] = Field(
        default_factory=lambda: [50, 80, 100], min_length=1, max_length=10
    )


class StatementClose(BaseModel):
    tenant_id: uuid.UUID
    period: BillingPeriod


__all__ = [
    "CURRENCY",
    "PERIOD",
    "BillingPeriod",
    "BreakdownRow",
    "Budget",
    "BudgetAlert",
    "BudgetCreate",
    "BudgetStatus",
    "Charge",
    "Costs",
    "CurrencyBalance",
    "CurrencyTotal",
    "LedgerBalance",
    "Price",
    "PriceCreate",
    "ProjectCost",
    "Statement",
    "StatementClose",
]
