"""Allocations' HTTP surface."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from gpuaas.allocations import service
from gpuaas.contracts.events.allocations import GpuDevice
from gpuaas.kit.auth import CurrentPrincipal, Principal
from gpuaas.kit.iam import require

router = APIRouter()


class HostEnrol(BaseModel):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]{0,62}$")
    host_class: str | None = Field(None, max_length=64)
    labels: dict[str, str] = Field(default_factory=dict, max_length=50)
    gpus: list[GpuDevice] = Field(default_factory=list, max_length=64)


class Host(BaseModel):
    host_id: uuid.UUID
    name: str
    status: str
    host_class: str | None
    labels: dict[str, str]
    gpus: list[GpuDevice]
    version: int


class HostEnrolment(Host):
    node_token: str = Field(description="shown once: the agent presents it to register")


@router.post("/hosts", response_model=HostEnrolment, status_code=201, tags=["hosts"])
async def enrol_host(request: Request, body: HostEnrol, principal: CurrentPrincipal) -> Any:
    async with request.app.state.kit.sessions() as session, session.begin():
        state, token = await service.enrol_host(
            session, principal, name=body.name, host_class=body.host_class, labels=body.labels, gpus=body.gpus
        )
    return {**state.model_dump(), "node_token": token}


@router.get("/hosts", response_model=list[Host], tags=["hosts"])
async def list_hosts(request: Request, _: Annotated[Principal, Depends(require("allocations.host.read"))]) -> Any:
    async with request.app.state.kit.sessions() as session:
        return await service.list_hosts(session)
