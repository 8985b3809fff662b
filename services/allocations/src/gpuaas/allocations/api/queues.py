"""Capacity queues (issue 29): operators set tenant queues and see every queue of a pool; tenant admins divide
their tenant's share among its projects and see their tenant's queues; project members read their project's
queue. The share history (`/queue-history`) is what the console's queue page charts."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from gpuaas.allocations import service
from gpuaas.allocations.api.schemas import CapacityQueue, QueueBody
from gpuaas.allocations.service.queue_history import QueueHistory, queue_history
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.kit.iam import action_doc
from gpuaas.kit.versioning import ExpectedVersion, set_etag

router = APIRouter(tags=["queues"])

GpuModel = Path(min_length=1, max_length=64, description="the pool: a GPU model, e.g. H100-80GB")
ModelFilter = Annotated[str | None, Query(min_length=1, max_length=64, description="keep one pool (GPU model)")]
Since = Annotated[
    datetime | None, Query(description="the window's start (with a time zone); default: 24 h before `until`")
]
Until = Annotated[datetime | None, Query(description="the window's end (with a time zone); default: now")]
Points = Annotated[
    int, Query(ge=2, le=500, description="instants in the series, evenly spaced (the last one is `until`)")
]
IF_MATCH = (
    "With If-Match (the ETag of a GET or PUT), 412 `version_mismatch` when the queue changed since; a queue "
    "without settings has no ETag, so only a PUT without If-Match creates it."
)
HISTORY = (
    "Each queue's share of its pool over a window: the GPUs it held at `points` instants from `since` to `until`, "
    "with the peak and the time-weighted mean of the interval ending at each instant (reconstructed from placement, "
    "admission and release times). 422 `invalid_window` when `since` is not before `until`, the window starts "
    "after now or over 10 years ago, spans over 62 days or a time has no time zone."
)


@router.put(
    "/tenants/{tenant_id}/queues/{gpu_model}",
    response_model=CapacityQueue,
    openapi_extra=action_doc("allocations.queue.operate"),
    description="Set a tenant's queue of a pool (operators). 422 when the guarantee is above the limit, a "
    "figure is negative, the model is offered by no host, or the tenant's projects are guaranteed more than this. "
    f"{IF_MATCH}",
)
async def put_tenant_queue(
    kit: Kit,
    tenant_id: uuid.UUID,
    body: QueueBody,
    principal: CurrentPrincipal,
    response: Response,
    expected: ExpectedVersion,
    gpu_model: str = GpuModel,
) -> CapacityQueue:
    async with kit.sessions() as session, session.begin():
        queue = await service.put_tenant_queue(
            session, principal, tenant_id, gpu_model, body.figures(), expected_version=expected
        )
    return _versioned(response, queue)


@router.get(
    "/tenants/{tenant_id}/queues/{gpu_model}",
    response_model=CapacityQueue,
    openapi_extra=action_doc("allocations.queue.manage"),
)
async def get_tenant_queue(
    kit: Kit, tenant_id: uuid.UUID, principal: CurrentPrincipal, response: Response, gpu_model: str = GpuModel
) -> CapacityQueue:
    async with kit.sessions() as session:
        return _versioned(response, await service.get_tenant_queue(session, principal, tenant_id, gpu_model))


@router.put(
    "/projects/{project_id}/queues/{gpu_model}",
    response_model=CapacityQueue,
    openapi_extra=action_doc("allocations.queue.manage"),
    description="Set a project's queue of a pool inside its tenant's share (tenant admins): the projects' "
    f"guarantees may not sum above the tenant's, nor a project's limit exceed the tenant's (422). {IF_MATCH}",
)
async def put_project_queue(
    kit: Kit,
    project_id: uuid.UUID,
    body: QueueBody,
    principal: CurrentPrincipal,
    response: Response,
    expected: ExpectedVersion,
    gpu_model: str = GpuModel,
) -> CapacityQueue:
    async with kit.sessions() as session, session.begin():
        queue = await service.put_project_queue(
            session, principal, project_id, gpu_model, body.figures(), expected_version=expected
        )
    return _versioned(response, queue)


@router.get(
    "/projects/{project_id}/queues/{gpu_model}",
    response_model=CapacityQueue,
    openapi_extra=action_doc("allocations.read"),
)
async def get_project_queue(
    kit: Kit, project_id: uuid.UUID, principal: CurrentPrincipal, response: Response, gpu_model: str = GpuModel
) -> CapacityQueue:
    async with kit.sessions() as session:
        return _versioned(response, await service.get_project_queue(session, principal, project_id, gpu_model))


@router.get("/queues", response_model=list[CapacityQueue], openapi_extra=action_doc("allocations.queue.operate"))
async def list_queues(
    kit: Kit, principal: CurrentPrincipal, gpu_model: str | None = Query(None, min_length=1, max_length=64)
) -> list[CapacityQueue]:
    """Every queue of each pool (or of `gpu_model`): usage against guarantee, limit and weight, borrowed,
    lent, and the waiting requests by reason (operators)."""
    async with kit.sessions() as session:
        return await service.list_queues(session, principal, gpu_model)


@router.get(
    "/tenants/{tenant_id}/queues",
    response_model=list[CapacityQueue],
    openapi_extra=action_doc("allocations.queue.manage"),
)
async def list_tenant_queues(
    kit: Kit, tenant_id: uuid.UUID, principal: CurrentPrincipal, gpu_model: ModelFilter = None
) -> list[CapacityQueue]:
    """The tenant's queue and its projects' queues of each pool where the tenant has settings, holds or waits for
    GPUs: usage against guarantee, limit and weight, borrowed, lent, waiting requests by reason (tenant admins)."""
    async with kit.sessions() as session:
        return await service.list_tenant_queues(session, principal, tenant_id, gpu_model)


@router.get(
    "/queue-history",
    response_model=QueueHistory,
    openapi_extra=action_doc("allocations.queue.operate"),
    description=f"{HISTORY} Every tenant's queue (operators).",
)
async def get_queue_history(
    kit: Kit,
    principal: CurrentPrincipal,
    gpu_model: ModelFilter = None,
    since: Since = None,
    until: Until = None,
    points: Points = 25,
) -> QueueHistory:
    async with kit.sessions() as session:
        return await queue_history(
            session, principal, tenant_id=None, gpu_model=gpu_model, since=since, until=until, points=points
        )


@router.get(
    "/tenants/{tenant_id}/queue-history",
    response_model=QueueHistory,
    openapi_extra=action_doc("allocations.queue.manage"),
    description=f"{HISTORY} The tenant's queue and its projects' queues (tenant admins).",
)
async def get_tenant_queue_history(
    kit: Kit,
    tenant_id: uuid.UUID,
    principal: CurrentPrincipal,
    gpu_model: ModelFilter = None,
    since: Since = None,
    until: Until = None,
    points: Points = 25,
) -> QueueHistory:
    async with kit.sessions() as session:
        return await queue_history(
            session, principal, tenant_id=tenant_id, gpu_model=gpu_model, since=since, until=until, points=points
        )


def _versioned(response: Response, queue: CapacityQueue) -> CapacityQueue:
    """The queue's version as its ETag (none while it has no settings: version 0 cannot be matched)."""
    if queue.version:
        set_etag(response, queue.version)
    return queue
