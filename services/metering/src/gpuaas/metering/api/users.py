"""Read views for tenants, projects and operators: meters, their usage records, and app usage reports."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Query

from gpuaas.kit import iam
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.metering import service
from gpuaas.metering.api.schemas import AppUsage, MeterOut, UsageRecordOut

router = APIRouter()


@router.get("/usage/app", response_model=list[AppUsage], tags=["app usage"])
async def list_app_usage(
    kit: Kit,
    principal: CurrentPrincipal,
    instance_id: uuid.UUID | None = None,
    project_id: uuid.UUID | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Any:
    async with kit.sessions() as session:
        return await service.list_app_usage(
            session, principal, instance_id=instance_id, project_id=project_id, limit=limit
        )


@router.get(
    "/meters/{allocation_id}",
    response_model=MeterOut,
    tags=["meters"],
    openapi_extra=iam.action_doc("metering.usage.read"),
)
async def get_meter(allocation_id: uuid.UUID, kit: Kit, principal: CurrentPrincipal) -> Any:
    """The meter of an allocation: when billing started, stopped (and why), or is suspended."""
    async with kit.sessions() as session:
        return await service.get_meter(session, principal, allocation_id)


@router.get("/meters", response_model=list[MeterOut], tags=["meters"])
async def list_meters(
    kit: Kit,
    principal: CurrentPrincipal,
    project_id: uuid.UUID | None = None,
    status: str | None = Query(None, pattern="^(open|suspended|closed)$"),
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Any:
    async with kit.sessions() as session:
        return await service.list_meters(session, principal, project_id=project_id, status=status, limit=limit)


@router.get(
    "/meters/{allocation_id}/usage",
    response_model=list[UsageRecordOut],
    tags=["meters"],
    openapi_extra=iam.action_doc("metering.usage.read"),
)
async def meter_usage(allocation_id: uuid.UUID, kit: Kit, principal: CurrentPrincipal) -> Any:
    """The usage records (closed windows) of an allocation, oldest first."""
    async with kit.sessions() as session:
        return await service.meter_usage(session, principal, allocation_id)
