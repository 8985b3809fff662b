"""Metering's request and response bodies. The responses are the use cases' views (service/views.py), so
what a use case answers and what the API shows cannot drift apart."""

from __future__ import annotations

import uuid
from decimal import Decimal

from pydantic import AwareDatetime, BaseModel, Field

from gpuaas.contracts.enums import AppUsageUnit
from gpuaas.metering.service.views import AppUsage, MeterOut, UsageRecordOut


class AppUsageCreate(BaseModel):
    instance_id: uuid.UUID
    unit: AppUsageUnit
    quantity: Decimal = Field(ge=0, max_digits=24, decimal_places=6, allow_inf_nan=False)
    idempotency_key: str = Field(min_length=1, max_length=200)
    occurred_at: AwareDatetime
    member_id: uuid.UUID | None = None


__all__ = ["AppUsage", "AppUsageCreate", "MeterOut", "UsageRecordOut"]
