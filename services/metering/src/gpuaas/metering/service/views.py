"""What metering's use cases answer: typed views of its rows, which are also the API's response bodies
(`api/schemas.py` exposes them next to the request bodies)."""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal

from pydantic import BaseModel, ConfigDict, Field

from gpuaas.contracts.enums import AppUsageUnit


class View(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class AppUsage(View):
    app_usage_record_id: uuid.UUID
    instance_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    app_slug: str
    member_id: uuid.UUID | None
    unit: AppUsageUnit
    quantity: Decimal
    idempotency_key: str
    occurred_at: datetime
    reported_by: str | None
    recorded_at: datetime
    duplicate: bool = False


class MeterOut(View):
    allocation_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    host_id: uuid.UUID | None
    shape: str
    gpu_model: str
    gpu_count: int
    status: str = Field(description="open | suspended | closed")
    opened_at: datetime
    changed_at: datetime | None
    closed_at: datetime | None = Field(description="billing stopped here (the release request)")
    close_reason: str | None
    suspended_at: datetime | None
    suspend_reason: str | None
    resumed_at: datetime | None
    billed_until: datetime = Field(description="GPU time before this instant is in usage records")
    late_stop_gpu_seconds: Decimal
    version: int


class UsageRecordOut(View):
    usage_record_id: uuid.UUID
    allocation_id: uuid.UUID
    project_id: uuid.UUID
    gpu_model: str
    shape: str
    gpu_count: int
    window_start: datetime
    window_end: datetime
    gpu_seconds: Decimal
    final: bool
