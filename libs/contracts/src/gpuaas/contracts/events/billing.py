"""`gpuaas.billing.v1`: prices, charges, budget alerts and statements (owner: billing).

Money is `Decimal` with an explicit currency on every amount. A charge is the rated form of
exactly one usage record (GPU or app) and is keyed by that record's id: the ledger refuses a
second charge for the same record, and a re-publish lands on the same partition.
"""

# Each event class narrows the envelope's `type: str` to its own Literal (the discriminator of its topic's
# union): pydantic's way, which the checker calls an incompatible override of a mutable field.
# pyright: reportIncompatibleVariableOverride=false
from __future__ import annotations

import uuid
from enum import StrEnum
from typing import Literal

from pydantic import Field

from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.envelope import Event, Payload
from gpuaas.contracts.scalars import Currency, Money, Quantity, Timestamp


class PriceUnit(StrEnum):
    """What one unit of a price is: a GPU-hour, or one app usage unit."""

    gpu_hour = "gpu_hour"
    tokens = "tokens"
    requests = "requests"
    model_seconds = "model_seconds"
    app_hours = "app_hours"


class PriceState(Payload):
    """One price-book entry: GPU time by model and shape, or an app unit by app."""

    aggregate_field = "sku"

    price_id: uuid.UUID
    sku: str = Field(description="stable SKU, e.g. 'gpu-hour.H100-80GB.baremetal'")
    description: str = ""
    unit: PriceUnit
    unit_price: Money
    currency: Currency
    gpu_model: str | None = None
    shape: CapacityShape | None = None
    app_slug: str | None = None
    effective_from: Timestamp
    effective_to: Timestamp | None = None


class ChargeState(Payload):
    """A rated usage record: one ledger posting (`amount = quantity * unit_price`)."""

    aggregate_field = "usage_record_id"

    charge_id: uuid.UUID
    usage_record_id: uuid.UUID = Field(description="the GPU or app usage record charged (once)")
    usage_kind: Literal["gpu", "app"]
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    sku: str
    price_id: uuid.UUID
    quantity: Quantity = Field(description="in `unit` (GPU-hours for GPU time)")
    unit: PriceUnit
    unit_price: Money
    amount: Money
    currency: Currency
    allocation_id: uuid.UUID | None = None
    instance_id: uuid.UUID | None = None
    app_slug: str | None = None
    usage_start: Timestamp
    usage_end: Timestamp
    posted_at: Timestamp
    period_start: Timestamp | None = Field(default=None, description="the billing period the charge counts in")
    transaction_id: uuid.UUID | None = Field(default=None, description="the ledger transaction of this charge")


class BudgetThreshold(Payload):
    aggregate_field = "budget_id"

    budget_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID | None = Field(default=None, description="None for a tenant-wide budget")
    period_start: Timestamp
    period_end: Timestamp
    limit_amount: Money
    spent_amount: Money
    currency: Currency
    threshold_percent: int = Field(ge=1, description="the crossed threshold, e.g. 80 or 100")
    crossed_at: Timestamp


class StatementLine(Payload):
    project_id: uuid.UUID
    sku: str
    app_slug: str | None = None
    quantity: Quantity
    unit: PriceUnit
    amount: Money


class StatementState(Payload):
    aggregate_field = "statement_id"

    statement_id: uuid.UUID
    tenant_id: uuid.UUID
    period_start: Timestamp
    period_end: Timestamp
    currency: Currency
    total_amount: Money
    lines: list[StatementLine] = Field(default_factory=list)
    closed_at: Timestamp


class PricePublished(Event):
    """A price takes effect at `effective_from` (superseding the SKU's previous price)."""

    type: Literal["price.published"] = "price.published"
    data: PriceState


class ChargePosted(Event):
    """A usage record was rated and posted to the ledger."""

    type: Literal["charge.posted"] = "charge.posted"
    data: ChargeState


class BudgetThresholdCrossed(Event):
    """Spend in the budget's period crossed one of its alert thresholds."""

    type: Literal["budget.threshold_crossed"] = "budget.threshold_crossed"
    data: BudgetThreshold


class StatementClosed(Event):
    """A tenant's statement for a period is final."""

    type: Literal["statement.closed"] = "statement.closed"
    data: StatementState


EVENTS: tuple[type[Event], ...] = (PricePublished, ChargePosted, BudgetThresholdCrossed, StatementClosed)
