"""Metering's read-only series for charts (issue 21): GPU-hours by project and GPU model."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter
from pydantic import AwareDatetime

from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.metering.service.gpu_hours import GpuHours, gpu_hours

router = APIRouter()


@router.get("/usage/gpu-hours", response_model=GpuHours, tags=["meters"])
async def list_gpu_hours(
    kit: Kit,
    principal: CurrentPrincipal,
    project_id: uuid.UUID | None = None,
    since: AwareDatetime | None = None,
    until: AwareDatetime | None = None,
) -> Any:
    """Recorded GPU-hours per project x GPU model, of one project or of every project the caller may read
    (operators: all), for windows starting in [since, until); default the current month."""
    async with kit.sessions() as session:
        return await gpu_hours(session, principal, project_id=project_id, since=since, until=until)
