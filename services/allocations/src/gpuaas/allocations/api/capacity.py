"""Operators' capacity view (issue 21): used/free GPUs per host class over time and the host x GPU
occupancy now, for the console's capacity chart and occupancy grid.

    GET /capacity?hours=24&points=25
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from gpuaas.allocations.service.capacity import Capacity, capacity
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import Principal
from gpuaas.kit.iam import require

router = APIRouter(tags=["hosts"])
Operator = Annotated[Principal, Depends(require("allocations.host.read"))]


@router.get("/capacity", response_model=Capacity)
async def get_capacity(
    kit: Kit,
    _: Operator,
    hours: Annotated[int, Query(ge=1, le=24 * 62, description="How far back the series goes")] = 24,
    points: Annotated[int, Query(ge=2, le=500, description="Instants in the series (the last one is now)")] = 25,
) -> Any:
    """Per host class: GPUs in total, used and free at `points` instants over the last `hours`
    (reconstructed from enrolment, placement and release times), and each host's GPUs with the allocation
    that holds each one now. Operators only."""
    async with kit.sessions() as session:
        return await capacity(session, hours=hours, points=points)
