"""Operators' routes: enrol hosts, rotate their node tokens, list, cordon, drain and uncordon them."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends

from gpuaas.allocations import service
from gpuaas.allocations.api.schemas import CordonBody, Host, HostEnrol, HostEnrolment, enrolment
from gpuaas.allocations.runtime import AllocationsRuntime
from gpuaas.contracts.events.allocations import HostState
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal, Principal
from gpuaas.kit.iam import action_doc, require

router = APIRouter(tags=["hosts"])
Operator = Annotated[Principal, Depends(require("allocations.host.read"))]


@router.post(
    "/hosts",
    response_model=HostEnrolment,
    status_code=201,
    openapi_extra=action_doc("allocations.host.manage"),
)
async def enrol_host(kit: Kit, body: HostEnrol, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        state, token = await service.enrol_host(
            session, principal, name=body.name, host_class=body.host_class, labels=body.labels, gpus=body.gpus
        )
    return enrolment(state, token)


@router.post(
    "/hosts/{host_id}/node-token",
    response_model=HostEnrolment,
    description="Issue a new node token (shown once); the previous one stops working.",
    openapi_extra=action_doc("allocations.host.manage"),
)
async def rotate_node_token(kit: Kit, host_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        state, token = await service.rotate_node_token(session, principal, host_id)
    return enrolment(state, token)


@router.get("/hosts", response_model=list[Host])
async def list_hosts(kit: Kit, _: Operator) -> list[HostState]:
    async with kit.sessions() as session:
        return await service.list_hosts(session)


@router.get("/hosts/{host_id}", response_model=Host)
async def get_host(kit: Kit, host_id: uuid.UUID, _: Operator) -> HostState:
    async with kit.sessions() as session:
        return await service.get_host(session, host_id)


@router.post("/hosts/{host_id}/cordon", response_model=Host, openapi_extra=action_doc("allocations.host.manage"))
async def cordon(kit: Kit, host_id: uuid.UUID, body: CordonBody, principal: CurrentPrincipal) -> HostState:
    async with kit.sessions() as session, session.begin():
        return await service.cordon_host(session, principal, host_id, reason=body.reason, drain=False)


@router.post(
    "/hosts/{host_id}/drain",
    response_model=Host,
    description="Cordon the host and request the release of every allocation on it.",
    openapi_extra=action_doc("allocations.host.manage"),
)
async def drain(kit: Kit, host_id: uuid.UUID, body: CordonBody, principal: CurrentPrincipal) -> HostState:
    async with kit.sessions() as session, session.begin():
        state = await service.cordon_host(session, principal, host_id, reason=body.reason, drain=True)
    kit.state_as(AllocationsRuntime).wakeups.notify(host_id)
    return state


@router.post("/hosts/{host_id}/uncordon", response_model=Host, openapi_extra=action_doc("allocations.host.manage"))
async def uncordon(kit: Kit, host_id: uuid.UUID, principal: CurrentPrincipal) -> HostState:
    async with kit.sessions() as session, session.begin():
        return await service.uncordon_host(session, principal, host_id)
