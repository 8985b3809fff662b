"""Capacity queues (issue 29): operators set tenant queues and see every queue of a pool; tenant admins divide
their tenant's share among its projects; project members read their project's queue."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Path, Query

from gpuaas.allocations import service
from gpuaas.allocations.api.schemas import CapacityQueue, QueueBody
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.kit.iam import action_doc

router = APIRouter(tags=["queues"])

GpuModel = Path(min_length=1, max_length=64, description="the pool: a GPU model, e.g. H100-80GB")


@router.put(
    "/tenants/{tenant_id}/queues/{gpu_model}",
    response_model=CapacityQueue,
    openapi_extra=action_doc("allocations.queue.operate"),
    description="Set a tenant's queue of a pool (operators). 422 when the guarantee is above the limit, a "
    "figure is negative, the model is offered by no host, or the tenant's projects are guaranteed more than this.",
)
async def put_tenant_queue(
    kit: Kit, tenant_id: uuid.UUID, body: QueueBody, principal: CurrentPrincipal, gpu_model: str = GpuModel
) -> CapacityQueue:
    async with kit.sessions() as session, session.begin():
        return await service.put_tenant_queue(session, principal, tenant_id, gpu_model, body.figures())


@router.get(
    "/tenants/{tenant_id}/queues/{gpu_model}",
    response_model=CapacityQueue,
    openapi_extra=action_doc("allocations.queue.manage"),
)
async def get_tenant_queue(
    kit: Kit, tenant_id: uuid.UUID, principal: CurrentPrincipal, gpu_model: str = GpuModel
) -> CapacityQueue:
    async with kit.sessions() as session:
        return await service.get_tenant_queue(session, principal, tenant_id, gpu_model)


@router.put(
    "/projects/{project_id}/queues/{gpu_model}",
    response_model=CapacityQueue,
    openapi_extra=action_doc("allocations.queue.manage"),
    description="Set a project's queue of a pool inside its tenant's share (tenant admins): the projects' "
    "guarantees may not sum above the tenant's, nor a project's limit exceed the tenant's (422).",
)
async def put_project_queue(
    kit: Kit, project_id: uuid.UUID, body: QueueBody, principal: CurrentPrincipal, gpu_model: str = GpuModel
) -> CapacityQueue:
    async with kit.sessions() as session, session.begin():
        return await service.put_project_queue(session, principal, project_id, gpu_model, body.figures())


@router.get(
    "/projects/{project_id}/queues/{gpu_model}",
    response_model=CapacityQueue,
    openapi_extra=action_doc("allocations.read"),
)
async def get_project_queue(
    kit: Kit, project_id: uuid.UUID, principal: CurrentPrincipal, gpu_model: str = GpuModel
) -> CapacityQueue:
    async with kit.sessions() as session:
        return await service.get_project_queue(session, principal, project_id, gpu_model)


@router.get("/queues", response_model=list[CapacityQueue], openapi_extra=action_doc("allocations.queue.operate"))
async def list_queues(
    kit: Kit, principal: CurrentPrincipal, gpu_model: str | None = Query(None, min_length=1, max_length=64)
) -> list[CapacityQueue]:
    """Every queue of each pool (or of `gpu_model`): usage against guarantee, limit and weight, borrowed,
    lent, and the waiting requests by reason (operators)."""
    async with kit.sessions() as session:
        return await service.list_queues(session, principal, gpu_model)
