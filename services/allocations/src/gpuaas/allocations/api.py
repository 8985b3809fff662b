"""Allocations' HTTP surface for people and service accounts (the agents' surface is agent_api.py)."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncSession
from sse_starlette.sse import EventSourceResponse

from gpuaas.allocations import domain, service
from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events.allocations import AllocationState, GpuDevice, SshGrantState, VolumeState
from gpuaas.kit.auth import CurrentPrincipal, Principal
from gpuaas.kit.iam import action_doc, require
from gpuaas.kit.versioning import IfMatch, expected_version, set_etag

router = APIRouter()
Operator = Annotated[Principal, Depends(require("allocations.host.read"))]


def _kit(request: Request) -> Any:
    return request.app.state.kit


# ------------------------------------------------------------------------------------------------- hosts


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
    inventory_source: str = "declared"
    agent_version: str | None = None
    last_heartbeat_at: datetime | None = None
    cordon_reason: str | None = None
    version: int


class HostEnrolment(Host):
    node_token: str = Field(description="shown once: the agent presents it to register")


class CordonBody(BaseModel):
    reason: str = Field(min_length=1, max_length=500)


@router.post(
    "/hosts",
    response_model=HostEnrolment,
    status_code=201,
    tags=["hosts"],
    openapi_extra=action_doc("allocations.host.manage"),
)
async def enrol_host(request: Request, body: HostEnrol, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        state, token = await service.enrol_host(
            session, principal, name=body.name, host_class=body.host_class, labels=body.labels, gpus=body.gpus
        )
    return {**state.model_dump(), "node_token": token}


@router.post(
    "/hosts/{host_id}/node-token",
    response_model=HostEnrolment,
    tags=["hosts"],
    description="Issue a new node token (shown once); the previous one stops working.",
    openapi_extra=action_doc("allocations.host.manage"),
)
async def rotate_node_token(request: Request, host_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        state, token = await service.rotate_node_token(session, principal, host_id)
    return {**state.model_dump(), "node_token": token}


@router.get("/hosts", response_model=list[Host], tags=["hosts"])
async def list_hosts(request: Request, _: Operator) -> Any:
    async with _kit(request).sessions() as session:
        return [h.model_dump() for h in await service.list_hosts(session)]


@router.get("/hosts/{host_id}", response_model=Host, tags=["hosts"])
async def get_host(request: Request, host_id: uuid.UUID, _: Operator) -> Any:
    async with _kit(request).sessions() as session:
        return service.host_state(await service.get_host(session, host_id)).model_dump()


@router.post(
    "/hosts/{host_id}/cordon", response_model=Host, tags=["hosts"], openapi_extra=action_doc("allocations.host.manage")
)
async def cordon(request: Request, host_id: uuid.UUID, body: CordonBody, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return (await service.cordon_host(session, principal, host_id, reason=body.reason, drain=False)).model_dump()


@router.post(
    "/hosts/{host_id}/drain",
    response_model=Host,
    tags=["hosts"],
    description="Cordon the host and request the release of every allocation on it.",
    openapi_extra=action_doc("allocations.host.manage"),
)
async def drain(request: Request, host_id: uuid.UUID, body: CordonBody, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        state = await service.cordon_host(session, principal, host_id, reason=body.reason, drain=True)
    _kit(request).extras["wakeups"].notify(host_id)
    return state.model_dump()


@router.post(
    "/hosts/{host_id}/uncordon",
    response_model=Host,
    tags=["hosts"],
    openapi_extra=action_doc("allocations.host.manage"),
)
async def uncordon(request: Request, host_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return (await service.uncordon_host(session, principal, host_id)).model_dump()


# ------------------------------------------------------------------------------------------- allocations


class AllocationCreate(BaseModel):
    name: str = Field("", max_length=100)
    shape: CapacityShape = CapacityShape.gpu_slice
    gpu_model: str = Field(min_length=1, max_length=64, examples=["H100-80GB"])
    gpu_count: int | None = Field(
        None,
        ge=1,
        le=64,
        description="required for gpu_slice; a baremetal "
        "allocation takes every GPU of its host (if given, the host must have exactly this many)",
    )
    host_class: str | None = Field(None, max_length=64, description="pin a host class")
    volume_ids: list[uuid.UUID] = Field(default_factory=list, max_length=16, description="volumes to attach at create")


class VolumeRef(BaseModel):
    volume_id: uuid.UUID
    name: str
    persist: bool
    access_mode: str
    after_release: str


class Allocation(AllocationState):
    volumes: list[VolumeRef] = Field(default_factory=list)
    after_release: str = Field(description="what persists after this allocation is released")
    awaiting_release_clearance: bool = False


class ResizeBody(BaseModel):
    gpu_count: int = Field(ge=1, le=64)


async def view(session: AsyncSession, row: Any) -> dict[str, Any]:
    return (await views(session, [row]))[0]


async def views(session: AsyncSession, rows: list[Any]) -> list[dict[str, Any]]:
    """The API shape of allocations; their volumes are read in one query for the whole list."""
    wanted = list({v for row in rows for v in row.volume_ids})
    by_id = {v.volume_id: v for v in await service.volume_summaries(session, wanted)}
    return [_render(row, [by_id[v] for v in row.volume_ids if v in by_id]) for row in rows]


def _render(row: Any, vols: list[Any]) -> dict[str, Any]:
    return {
        **service.alloc_state(row).model_dump(),
        "volumes": [
            {
                "volume_id": v.volume_id,
                "name": v.name,
                "persist": v.persist,
                "access_mode": v.access_mode,
                "after_release": domain.after_release(v.persist),
            }
            for v in vols
        ],
        "after_release": domain.allocation_after_release([(v.name, v.persist) for v in vols]),
        "awaiting_release_clearance": row.awaiting_clearance_since is not None,
    }


@router.post(
    "/projects/{project_id}/allocations",
    response_model=Allocation,
    status_code=201,
    tags=["allocations"],
    openapi_extra=action_doc("allocations.create"),
)
async def create_allocation(
    request: Request, response: Response, project_id: uuid.UUID, body: AllocationCreate, principal: CurrentPrincipal
) -> Any:
    kit = _kit(request)
    async with kit.sessions() as session, session.begin():
        row = await service.create_allocation(
            session,
            principal,
            project_id=project_id,
            name=body.name,
            shape=body.shape,
            gpu_model=body.gpu_model,
            gpu_count=body.gpu_count,
            host_class=body.host_class,
            volume_ids=body.volume_ids,
        )
        out = await view(session, row)
    kit.extras["wakeups"].notify(row.host_id)
    set_etag(response, row.version)
    return out


@router.get(
    "/projects/{project_id}/allocations",
    response_model=list[Allocation],
    tags=["allocations"],
    openapi_extra=action_doc("allocations.read"),
)
async def list_project_allocations(
    request: Request, project_id: uuid.UUID, principal: CurrentPrincipal, include_released: bool = False
) -> Any:
    async with _kit(request).sessions() as session:
        rows = await service.list_allocations(
            session, principal, project_id=project_id, include_released=include_released
        )
        return await views(session, rows)


@router.get("/allocations", response_model=list[Allocation], tags=["allocations"])
async def list_allocations(request: Request, principal: CurrentPrincipal, include_released: bool = False) -> Any:
    async with _kit(request).sessions() as session:
        rows = await service.list_allocations(session, principal, project_id=None, include_released=include_released)
        return await views(session, rows)


@router.get(
    "/allocations/{allocation_id}",
    response_model=Allocation,
    tags=["allocations"],
    openapi_extra=action_doc("allocations.read"),
)
async def get_allocation(
    request: Request, response: Response, allocation_id: uuid.UUID, principal: CurrentPrincipal
) -> Any:
    """The allocation, with its version as the `ETag`: send it back as `If-Match` on a change."""
    async with _kit(request).sessions() as session:
        row = await service.load_allocation(session, principal, allocation_id, "allocations.read")
        set_etag(response, row.version)
        return await view(session, row)


async def _mutate(
    request: Request, response: Response, if_match: str | None, fn: Any, *args: Any, **kwargs: Any
) -> Any:
    """Run a change of the allocation as of the version `If-Match` names; answer its new version as the ETag."""
    expected = expected_version(if_match)
    kit = _kit(request)
    async with kit.sessions() as session, session.begin():
        row = await fn(session, *args, expected_version=expected, **kwargs)
        out = await view(session, row)
    if row.host_id:
        kit.extras["wakeups"].notify(row.host_id)
    set_etag(response, row.version)
    return out


@router.post(
    "/allocations/{allocation_id}/restart",
    response_model=Allocation,
    status_code=202,
    tags=["allocations"],
    description="Restart in place (asynchronous): same id, host, endpoint, keys "
    "and volumes; running sessions and processes are interrupted.",
    openapi_extra=action_doc("allocations.update"),
)
async def restart(
    request: Request,
    response: Response,
    allocation_id: uuid.UUID,
    principal: CurrentPrincipal,
    if_match: IfMatch = None,
) -> Any:
    return await _mutate(request, response, if_match, service.restart_allocation, principal, allocation_id)


@router.post(
    "/allocations/{allocation_id}/resize",
    response_model=Allocation,
    status_code=202,
    tags=["allocations"],
    description="Resize a gpu_slice on its host (asynchronous).",
    openapi_extra=action_doc("allocations.update"),
)
async def resize(
    request: Request,
    response: Response,
    allocation_id: uuid.UUID,
    body: ResizeBody,
    principal: CurrentPrincipal,
    if_match: IfMatch = None,
) -> Any:
    return await _mutate(
        request, response, if_match, service.resize_allocation, principal, allocation_id, body.gpu_count
    )


@router.post(
    "/allocations/{allocation_id}/release",
    response_model=Allocation,
    status_code=202,
    tags=["allocations"],
    description="Release (asynchronous); billing stops now.",
    openapi_extra=action_doc("allocations.release"),
)
async def release(
    request: Request,
    response: Response,
    allocation_id: uuid.UUID,
    principal: CurrentPrincipal,
    if_match: IfMatch = None,
) -> Any:
    return await _mutate(request, response, if_match, service.release_allocation, principal, allocation_id, retry=False)


@router.post(
    "/allocations/{allocation_id}/retry-release",
    response_model=Allocation,
    status_code=202,
    tags=["allocations"],
    openapi_extra=action_doc("allocations.release"),
)
async def retry_release(
    request: Request,
    response: Response,
    allocation_id: uuid.UUID,
    principal: CurrentPrincipal,
    if_match: IfMatch = None,
) -> Any:
    return await _mutate(request, response, if_match, service.release_allocation, principal, allocation_id, retry=True)


class TimelineEntry(BaseModel):
    seq: int
    entry_id: uuid.UUID
    phase: str
    status: str
    message: str
    task_id: uuid.UUID | None
    started_at: datetime
    finished_at: datetime | None


@router.get(
    "/allocations/{allocation_id}/timeline",
    response_model=list[TimelineEntry],
    tags=["allocations"],
    openapi_extra=action_doc("allocations.read"),
)
async def get_timeline(
    request: Request, allocation_id: uuid.UUID, principal: CurrentPrincipal, after: int = Query(0, ge=0)
) -> Any:
    async with _kit(request).sessions() as session:
        await service.load_allocation(session, principal, allocation_id, "allocations.read")
        return await service.timeline_entries(session, allocation_id, after)


@router.get(
    "/allocations/{allocation_id}/timeline/stream",
    tags=["allocations"],
    description="Server-sent events: every timeline entry (`event: timeline`), then new ones as they "
    "happen. `?access_token=` is accepted for browsers.",
    openapi_extra=action_doc("allocations.read"),
)
async def stream_timeline(
    request: Request, allocation_id: uuid.UUID, principal: CurrentPrincipal, after: int = Query(0, ge=0)
) -> EventSourceResponse:
    kit = _kit(request)
    async with kit.sessions() as session:
        await service.load_allocation(session, principal, allocation_id, "allocations.read")

    async def events() -> Any:
        last = after
        while True:
            async with kit.sessions() as session:
                entries = await service.timeline_entries(session, allocation_id, last)
            for e in entries:
                last = e["seq"]
                yield {
                    "event": "timeline",
                    "id": str(e["seq"]),
                    "data": json.dumps(TimelineEntry.model_validate(e).model_dump(mode="json")),
                }
            if await request.is_disconnected():
                return
            await asyncio.sleep(0.5)

    return EventSourceResponse(events(), ping=15)


# ---------------------------------------------------------------------------------------------- SSH keys


class SshKeyCreate(BaseModel):
    name: str = Field(min_length=1, max_length=100)
    public_key: str = Field(min_length=20, max_length=16_000)


class SshKey(BaseModel):
    key_id: uuid.UUID
    name: str
    public_key: str
    fingerprint: str
    created_at: datetime


@router.post("/ssh-keys", response_model=SshKey, status_code=201, tags=["ssh"])
async def add_key(request: Request, body: SshKeyCreate, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return dict(
            (await service.add_ssh_key(session, principal, name=body.name, public_key=body.public_key))._mapping
        )


@router.get("/ssh-keys", response_model=list[SshKey], tags=["ssh"])
async def list_keys(request: Request, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session:
        return [dict(r._mapping) for r in await service.list_ssh_keys(session, principal)]


@router.delete("/ssh-keys/{key_id}", status_code=204, tags=["ssh"])
async def delete_key(request: Request, key_id: uuid.UUID, principal: CurrentPrincipal) -> Response:
    async with _kit(request).sessions() as session, session.begin():
        await service.delete_ssh_key(session, principal, key_id)
    return Response(status_code=204)


class GrantCreate(BaseModel):
    user_id: uuid.UUID = Field(description="the project member who gets access")
    public_key: str = Field(min_length=20, max_length=16_000, description="the grantee's own OpenSSH public key")


@router.post("/allocations/{allocation_id}/ssh-grants", response_model=SshGrantState, status_code=201, tags=["ssh"])
async def create_grant(
    request: Request,
    response: Response,
    allocation_id: uuid.UUID,
    body: GrantCreate,
    principal: CurrentPrincipal,
    if_match: IfMatch = None,
) -> Any:
    """`If-Match` and the answered `ETag` are the allocation's version (a grant does not change it)."""
    expected = expected_version(if_match)
    kit = _kit(request)
    async with kit.sessions() as session, session.begin():
        row = await service.create_grant(
            session,
            principal,
            allocation_id,
            user_id=body.user_id,
            public_key=body.public_key,
            expected_version=expected,
        )
        alloc = await service.load_allocation(session, principal, allocation_id, "allocations.read")
    kit.extras["wakeups"].notify(alloc.host_id)
    set_etag(response, alloc.version)
    return service.grant_state(row).model_dump()


@router.get(
    "/allocations/{allocation_id}/ssh-grants",
    response_model=list[SshGrantState],
    tags=["ssh"],
    openapi_extra=action_doc("allocations.read"),
)
async def list_grants(request: Request, allocation_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session:
        return [
            service.grant_state(r).model_dump() for r in await service.list_grants(session, principal, allocation_id)
        ]


@router.delete("/allocations/{allocation_id}/ssh-grants/{grant_id}", response_model=SshGrantState, tags=["ssh"])
async def revoke_grant(
    request: Request,
    response: Response,
    allocation_id: uuid.UUID,
    grant_id: uuid.UUID,
    principal: CurrentPrincipal,
    if_match: IfMatch = None,
) -> Any:
    """`If-Match` and the answered `ETag` are the allocation's version (a grant does not change it)."""
    expected = expected_version(if_match)
    kit = _kit(request)
    async with kit.sessions() as session, session.begin():
        row = await service.revoke_grant(session, principal, allocation_id, grant_id, expected_version=expected)
        alloc = await service.load_allocation(session, principal, allocation_id, "allocations.read")
    kit.extras["wakeups"].notify(alloc.host_id)
    set_etag(response, alloc.version)
    return service.grant_state(row).model_dump()


# ----------------------------------------------------------------------------------------------- volumes


class VolumeCreate(BaseModel):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    size_gb: int = Field(ge=1, le=100_000)
    persist: bool = Field(True, description="keep the data after the allocations it is attached to are released")
    access_mode: Literal["single_writer", "multi_attach"] = "single_writer"


class Volume(VolumeState):
    after_release: str


def _volume_view(state: VolumeState) -> dict[str, Any]:
    return {**state.model_dump(), "after_release": domain.after_release(state.persist)}


class AttachBody(BaseModel):
    volume_id: uuid.UUID


@router.post(
    "/projects/{project_id}/volumes",
    response_model=Volume,
    status_code=201,
    tags=["storage"],
    openapi_extra=action_doc("allocations.volume.manage"),
)
async def create_volume(
    request: Request, project_id: uuid.UUID, body: VolumeCreate, principal: CurrentPrincipal
) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return _volume_view(
            await service.create_volume(
                session,
                principal,
                project_id,
                name=body.name,
                size_gb=body.size_gb,
                persist=body.persist,
                access_mode=body.access_mode,
            )
        )


@router.get(
    "/projects/{project_id}/volumes",
    response_model=list[Volume],
    tags=["storage"],
    openapi_extra=action_doc("allocations.read"),
)
async def list_volumes(request: Request, project_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session:
        return [_volume_view(v) for v in await service.list_volumes(session, principal, project_id)]


@router.get(
    "/volumes/{volume_id}", response_model=Volume, tags=["storage"], openapi_extra=action_doc("allocations.read")
)
async def get_volume(request: Request, volume_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session:
        row = await service.load_volume(session, principal, volume_id, "allocations.read")
        return _volume_view(await service.volume_state(session, row))


@router.delete(
    "/volumes/{volume_id}",
    response_model=Volume,
    tags=["storage"],
    openapi_extra=action_doc("allocations.volume.manage"),
)
async def delete_volume(request: Request, volume_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return _volume_view(await service.delete_volume(session, principal, volume_id))


@router.post(
    "/allocations/{allocation_id}/volumes",
    response_model=Volume,
    status_code=201,
    tags=["storage"],
    openapi_extra=action_doc("allocations.update"),
)
async def attach(
    request: Request,
    response: Response,
    allocation_id: uuid.UUID,
    body: AttachBody,
    principal: CurrentPrincipal,
    if_match: IfMatch = None,
) -> Any:
    """`If-Match` and the answered `ETag` are the allocation's version, which the attachment moves on."""
    expected = expected_version(if_match)
    kit = _kit(request)
    async with kit.sessions() as session, session.begin():
        state = await service.attach_volume(
            session, principal, allocation_id, body.volume_id, expected_version=expected
        )
        alloc = await service.load_allocation(session, principal, allocation_id, "allocations.read")
    kit.extras["wakeups"].notify(alloc.host_id)
    set_etag(response, alloc.version)
    return _volume_view(state)


@router.delete(
    "/allocations/{allocation_id}/volumes/{volume_id}",
    response_model=Volume,
    tags=["storage"],
    openapi_extra=action_doc("allocations.update"),
)
async def detach(
    request: Request,
    response: Response,
    allocation_id: uuid.UUID,
    volume_id: uuid.UUID,
    principal: CurrentPrincipal,
    if_match: IfMatch = None,
) -> Any:
    """`If-Match` and the answered `ETag` are the allocation's version, which the detachment moves on."""
    expected = expected_version(if_match)
    kit = _kit(request)
    async with kit.sessions() as session, session.begin():
        state = await service.detach_volume(session, principal, allocation_id, volume_id, expected_version=expected)
        alloc = await service.load_allocation(session, principal, allocation_id, "allocations.read")
    kit.extras["wakeups"].notify(alloc.host_id)
    set_etag(response, alloc.version)
    return _volume_view(state)


# ------------------------------------------------------------------------------------------------ quotas


class QuotaBody(BaseModel):
    max_gpus: int = Field(ge=0, le=100_000)


class Quota(BaseModel):
    project_id: uuid.UUID
    max_gpus: int | None
    gpus_in_use: int = 0


@router.put(
    "/projects/{project_id}/quota",
    response_model=Quota,
    tags=["quotas"],
    openapi_extra=action_doc("allocations.quota.manage"),
)
async def set_quota(request: Request, project_id: uuid.UUID, body: QuotaBody, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        await service.set_quota(session, principal, project_id, body.max_gpus)
        return await service.get_quota(session, principal, project_id)


@router.get(
    "/projects/{project_id}/quota", response_model=Quota, tags=["quotas"], openapi_extra=action_doc("allocations.read")
)
async def get_quota(request: Request, project_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session:
        return await service.get_quota(session, principal, project_id)
