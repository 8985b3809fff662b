"""Operators' routes: enrol and re-enrol hosts, rotate their node tokens, list, cordon, drain and uncordon
them, and the tenancy override of hosts that do not isolate tenants."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends

from gpuaas.allocations import service
from gpuaas.allocations.api.schemas import (
    CordonBody,
    Host,
    HostEnrol,
    HostEnrolment,
    HostReenrol,
    HostTenancy,
    enrolment,
)
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
            session,
            principal,
            name=body.name,
            host_class=body.host_class,
            labels=body.labels,
            gpus=body.gpus,
            pins=body.pins(),
        )
    return enrolment(state, token)


@router.post(
    "/hosts/{host_id}/re-enrol",
    response_model=HostEnrolment,
    description="A new node token (shown once) and the pinned SSH endpoint and host key reset: to the ones given, "
    "else the agent's next registration pins them. For a reinstalled host; audited.",
    openapi_extra=action_doc("allocations.host.manage"),
)
async def reenrol_host(kit: Kit, host_id: uuid.UUID, body: HostReenrol, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        state, token = await service.reenrol_host(session, principal, host_id, reason=body.reason, pins=body.pins())
    return enrolment(state, token)


@router.put(
    "/hosts/{host_id}/tenancy",
    response_model=Host,
    description="Allow (or stop allowing) allocations of several tenants on a host whose driver does not isolate "
    "tenants. Audited with the reason.",
    openapi_extra=action_doc("allocations.host.manage"),
)
async def set_tenancy(kit: Kit, host_id: uuid.UUID, body: HostTenancy, principal: CurrentPrincipal) -> HostState:
    async with kit.sessions() as session, session.begin():
        return await service.set_tenancy(
            session, principal, host_id, shared_tenancy_allowed=body.shared_tenancy_allowed, reason=body.reason
        )


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
