"""What billing's use cases answer: typed views of its rows, which are also the API's response bodies
(`api/schemas.py` exposes them next to the request bodies).

Each reads straight from a row (`Charge.model_validate(row)`); amounts stay the `Decimal` stored (or
given, for a price just published), so the JSON carries the same digits the ledger holds.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict

from gpuaas.contracts.events.billing import PriceUnit


class View(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class Price(View):
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
    # Only for a price just published: how much waiting (unrated) usage it rated at once.
    rated_waiting_usage: int | None = None


class Budget(View):
    budget_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID | None
    name: str
    limit_amount: Decimal
    currency: str
    thresholds: list[int]
    created_at: datetime


class BudgetAlert(View):
    threshold_percent: int
    spent_amount: Decimal
    crossed_at: datetime


class BudgetStatus(Budget):
    # A budget with its spend and the alerts it raised in one period.
    period_start: datetime
    spent_amount: Decimal
    alerts: list[BudgetAlert]


class ProjectCost(View):
    project_id: uuid.UUID
    currency: str
    gpu_amount: Decimal
    app_amount: Decimal
    amount: Decimal


class CurrencyTotal(View):
    currency: str
    gpu_amount: Decimal
    app_amount: Decimal
    amount: Decimal


class Costs(View):
    tenant_id: uuid.UUID
    period_start: datetime
    period_end: datetime
    totals: list[CurrencyTotal]
    projects: list[ProjectCost]


class BreakdownRow(View):
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    sku: str
    app_slug: str | None
    unit: str
    currency: str
    quantity: Decimal
    amount: Decimal
    charges: int


class Charge(View):
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


class CurrencyBalance(View):
    currency: str
    debits: Decimal
    credits: Decimal
    entries: int


class LedgerBalance(View):
    transactions: int
    currencies: list[CurrencyBalance]
    unbalanced_transactions: int
    balanced: bool


class Statement(View):
    # A closed statement; `lines` as the contract's StatementLine (JSON-shaped when read back).
    statement_id: uuid.UUID
    tenant_id: uuid.UUID
    period_start: datetime
    period_end: datetime
    currency: str
    total_amount: Decimal
    lines: list[dict[str, Any]]
    closed_at: datetime
