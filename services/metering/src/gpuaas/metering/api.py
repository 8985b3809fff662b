"""Metering's HTTP surface: the app usage producer API and read views of meters and usage."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import AwareDatetime, BaseModel, Field
from sqlalchemy import select

from gpuaas.contracts.enums import AppUsageUnit
from gpuaas.kit import iam
from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.kit.errors import NotFound
from gpuaas.metering import service
from gpuaas.metering.models import app_usage_records, meters, usage_records
from gpuaas.metering.settings import Settings

router = APIRouter()


class AppUsageCreate(BaseModel):
    instance_id: uuid.UUID
    unit: AppUsageUnit
    quantity: Decimal = Field(ge=0, max_digits=24, decimal_places=6, allow_inf_nan=False)
    idempotency_key: str = Field(min_length=1, max_length=200)
    occurred_at: AwareDatetime
    member_id: uuid.UUID | None = None


class AppUsage(BaseModel):
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


class MeterOut(BaseModel):
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


class UsageRecordOut(BaseModel):
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


def _kit(request: Request) -> Any:
    return request.app.state.kit


@router.post("/usage/app", response_model=AppUsage, status_code=201, tags=["app usage"])
async def post_app_usage(
    body: AppUsageCreate, request: Request, response: Response, principal: CurrentPrincipal
) -> Any:
    """Report app-level usage (tokens, requests, model-seconds) of an instance, once per `idempotency_key`.

    201 when recorded; 200 with `duplicate: true` when this key was already recorded with the same
    body; 409 `idempotency_key_reused` for the same key with a different body; 422
    `usage_out_of_window` when `occurred_at` is outside the accepted window (answer says which).
    Service accounts need the `app-controller` scope in the instance's project; operators may backfill.
    """
    kit = _kit(request)
    s: Settings = kit.settings
    async with kit.sessions() as session, session.begin():
        out = await service.record_app_usage(
            session,
            principal,
            instance_id=body.instance_id,
            unit=body.unit,
            quantity=body.quantity,
            idempotency_key=body.idempotency_key,
            occurred_at=body.occurred_at.astimezone(UTC),
            member_id=body.member_id,
            now=datetime.now(UTC),
            late=timedelta(seconds=s.app_usage_late_s),
            skew=timedelta(seconds=s.app_usage_skew_s),
        )
    if out["duplicate"]:
        response.status_code = 200
    return out


@router.get("/usage/app", response_model=list[AppUsage], tags=["app usage"])
async def list_app_usage(
    request: Request,
    principal: CurrentPrincipal,
    instance_id: uuid.UUID | None = None,
    project_id: uuid.UUID | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Any:
    async with _kit(request).sessions() as session:
        q = select(app_usage_records).order_by(app_usage_records.c.occurred_at.desc()).limit(limit)
        if project_id is not None:
            await iam.authorize(session, principal, "metering.usage.read", project_id=project_id)
            q = q.where(app_usage_records.c.project_id == project_id)
        else:
            visible = await iam.visible_project_ids(session, principal)
            if visible is not None:
                q = q.where(app_usage_records.c.project_id.in_(visible))
        if instance_id is not None:
            q = q.where(app_usage_records.c.instance_id == instance_id)
        rows = (await session.execute(q)).all()
    return [service._app_usage_out(r, duplicate=False) for r in rows]


async def _meter_row(session: Any, principal: Any, allocation_id: uuid.UUID) -> Any:
    row = (await session.execute(select(meters).where(meters.c.allocation_id == allocation_id))).first()
    if row is None:
        raise NotFound("no meter for this allocation", code="meter_not_found")
    await iam.authorize(session, principal, "metering.usage.read", project_id=row.project_id)
    return row


@router.get(
    "/meters/{allocation_id}",
    response_model=MeterOut,
    tags=["meters"],
    openapi_extra=iam.action_doc("metering.usage.read"),
)
async def get_meter(allocation_id: uuid.UUID, request: Request, principal: CurrentPrincipal) -> Any:
    """The meter of an allocation: when billing started, stopped (and why), or is suspended."""
    async with _kit(request).sessions() as session:
        return (await _meter_row(session, principal, allocation_id))._mapping


@router.get("/meters", response_model=list[MeterOut], tags=["meters"])
async def list_meters(
    request: Request,
    principal: CurrentPrincipal,
    project_id: uuid.UUID | None = None,
    status: str | None = Query(None, pattern="^(open|suspended|closed)$"),
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Any:
    async with _kit(request).sessions() as session:
        q = select(meters).order_by(meters.c.opened_at.desc()).limit(limit)
        if project_id is not None:
            await iam.authorize(session, principal, "metering.usage.read", project_id=project_id)
            q = q.where(meters.c.project_id == project_id)
        else:
            visible = await iam.visible_project_ids(session, principal)
            if visible is not None:
                q = q.where(meters.c.project_id.in_(visible))
        if status:
            q = q.where(meters.c.status == status)
        return [r._mapping for r in (await session.execute(q)).all()]


@router.get(
    "/meters/{allocation_id}/usage",
    response_model=list[UsageRecordOut],
    tags=["meters"],
    openapi_extra=iam.action_doc("metering.usage.read"),
)
async def meter_usage(allocation_id: uuid.UUID, request: Request, principal: CurrentPrincipal) -> Any:
    """The usage records (closed windows) of an allocation, oldest first."""
    async with _kit(request).sessions() as session:
        await _meter_row(session, principal, allocation_id)
        rows = (
            await session.execute(
                select(usage_records)
                .where(usage_records.c.allocation_id == allocation_id)
                .order_by(usage_records.c.window_start)
            )
        ).all()
    return [r._mapping for r in rows]
