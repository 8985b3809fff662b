"""People's and service accounts' routes: allocations and their timeline, SSH keys and grants, volumes,
quotas. Every change of an allocation ends in `commit_change` (wake-up + ETag)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.types import DecoratedCallable
from sse_starlette.sse import EventSourceResponse

from gpuaas.allocations import service
from gpuaas.allocations.api.changes import commit_change
from gpuaas.allocations.api.schemas import (
    Allocation,
    AllocationCreate,
    AttachBody,
    GrantCreate,
    Quota,
    QuotaBody,
    ResizeBody,
    SshHostKey,
    SshKey,
    SshKeyCreate,
    TimelineEntry,
    Volume,
    VolumeCreate,
    volume_view,
)
from gpuaas.contracts.events.allocations import SshGrantState
from gpuaas.kit import revocation
from gpuaas.kit.app import Kit, KitRuntime
from gpuaas.kit.auth import CurrentPrincipal, Principal
from gpuaas.kit.iam import action_doc
from gpuaas.kit.paging import PageRequest, page_params, set_next_link
from gpuaas.kit.versioning import ExpectedVersion, set_etag

router = APIRouter()


def _allocation_read(path: str, response_model: object) -> Callable[[DecoratedCallable], DecoratedCallable]:
    return router.get(
        path, response_model=response_model, tags=["allocations"], openapi_extra=action_doc("allocations.read")
    )


def _allocation_change(
    path: str, action: str, description: str | None = None
) -> Callable[[DecoratedCallable], DecoratedCallable]:
    """An asynchronous change of an allocation (202), answering the allocation with its new ETag."""
    return router.post(
        path,
        response_model=Allocation,
        status_code=202,
        tags=["allocations"],
        description=description,
        openapi_extra=action_doc(action),
    )


# ------------------------------------------------------------------------------------------- allocations


@router.post(
    "/projects/{project_id}/allocations",
    response_model=Allocation,
    status_code=201,
    tags=["allocations"],
    openapi_extra=action_doc("allocations.create"),
    description="201 with `status: provisioning` when placed now, or `status: queued` (with `pending_reason` and "
    "`queue_position`) when it waits for capacity; `queue: false` answers 409 instead of waiting.",
)
async def create_allocation(
    kit: Kit, response: Response, project_id: uuid.UUID, body: AllocationCreate, principal: CurrentPrincipal
) -> Allocation:
    return await commit_change(
        kit,
        response,
        lambda session: service.create_allocation(
            session,
            principal,
            project_id=project_id,
            name=body.name,
            shape=body.shape,
            gpu_model=body.gpu_model,
            gpu_count=body.gpu_count,
            host_class=body.host_class,
            volume_ids=body.volume_ids,
            runtime=body.runtime,
            queue=body.queue,
            priority=body.priority,
            max_wait_s=body.max_wait,
            on_preemption=body.on_preemption,
        ),
    )


_ALLOCATION_PAGE = Depends(page_params(default=500, maximum=1000))


@_allocation_read("/projects/{project_id}/allocations", list[Allocation])
async def list_project_allocations(
    kit: Kit,
    request: Request,
    response: Response,
    project_id: uuid.UUID,
    principal: CurrentPrincipal,
    include_released: bool = False,
    page: PageRequest = _ALLOCATION_PAGE,
) -> list[Allocation]:
    """Newest first; `?limit=&cursor=` pages (`Link: <...>; rel="next"` while more follow)."""
    async with kit.sessions() as session:
        items, next_cursor = await service.list_allocations(
            session, principal, project_id=project_id, include_released=include_released, page=page
        )
    set_next_link(request, response, next_cursor)
    return items


@router.get("/allocations", response_model=list[Allocation], tags=["allocations"])
async def list_allocations(
    kit: Kit,
    request: Request,
    response: Response,
    principal: CurrentPrincipal,
    include_released: bool = False,
    page: PageRequest = _ALLOCATION_PAGE,
) -> list[Allocation]:
    """Newest first; `?limit=&cursor=` pages (`Link: <...>; rel="next"` while more follow)."""
    async with kit.sessions() as session:
        items, next_cursor = await service.list_allocations(
            session, principal, project_id=None, include_released=include_released, page=page
        )
    set_next_link(request, response, next_cursor)
    return items


@_allocation_read("/allocations/{allocation_id}", Allocation)
async def get_allocation(
    kit: Kit, response: Response, allocation_id: uuid.UUID, principal: CurrentPrincipal
) -> Allocation:
    """The allocation, with its version as the `ETag`: send it back as `If-Match` on a change."""
    async with kit.sessions() as session:
        allocation = await service.get_allocation(session, principal, allocation_id)
    set_etag(response, allocation.version)
    return allocation


@_allocation_change(
    "/allocations/{allocation_id}/restart",
    "allocations.update",
    "Restart in place (asynchronous): same id, host, endpoint, keys "
    "and volumes; running sessions and processes are interrupted. When its host is lost (unreachable or "
    "decommissioned) it is released and re-run elsewhere: the answer is the NEW allocation (`requeued_from` names "
    "this one, its volumes move to it), `provisioning` on another host or `queued` until one fits.",
)
async def restart(
    kit: Kit, response: Response, allocation_id: uuid.UUID, principal: CurrentPrincipal, expected: ExpectedVersion
) -> Allocation:
    return await commit_change(
        kit,
        response,
        lambda session: service.restart_allocation(session, principal, allocation_id, expected_version=expected),
    )


@_allocation_change(
    "/allocations/{allocation_id}/resize",
    "allocations.update",
    "Resize a gpu_slice on its host (asynchronous). A resize up its host cannot give now (or past its project's "
    "quota or queue limit) waits: the allocation runs on and shows `pending_resize_gpus` / `pending_resize_reason` "
    "until admission grants it (`resizing`); `queue: false` answers 409 instead. 409 `resize_pending` while one waits.",
)
async def resize(
    kit: Kit,
    response: Response,
    allocation_id: uuid.UUID,
    body: ResizeBody,
    principal: CurrentPrincipal,
    expected: ExpectedVersion,
) -> Allocation:
    return await commit_change(
        kit,
        response,
        lambda session: service.resize_allocation(
            session, principal, allocation_id, body.gpu_count, queue=body.queue, expected_version=expected
        ),
    )


@router.delete(
    "/allocations/{allocation_id}/resize",
    response_model=Allocation,
    tags=["allocations"],
    openapi_extra=action_doc("allocations.update"),
    description="Cancel a resize that waits for GPUs (nothing was reserved for it); 409 `no_pending_resize` when "
    "none waits.",
)
async def cancel_resize(
    kit: Kit, response: Response, allocation_id: uuid.UUID, principal: CurrentPrincipal, expected: ExpectedVersion
) -> Allocation:
    return await commit_change(
        kit,
        response,
        lambda session: service.cancel_pending_resize(session, principal, allocation_id, expected_version=expected),
    )


@_allocation_change(
    "/allocations/{allocation_id}/release", "allocations.release", "Release (asynchronous); billing stops now."
)
async def release(
    kit: Kit, response: Response, allocation_id: uuid.UUID, principal: CurrentPrincipal, expected: ExpectedVersion
) -> Allocation:
    return await _release(kit, response, allocation_id, principal, expected, retry=False)


@_allocation_change("/allocations/{allocation_id}/retry-release", "allocations.release")
async def retry_release(
    kit: Kit, response: Response, allocation_id: uuid.UUID, principal: CurrentPrincipal, expected: ExpectedVersion
) -> Allocation:
    return await _release(kit, response, allocation_id, principal, expected, retry=True)


async def _release(
    kit: KitRuntime,
    response: Response,
    allocation_id: uuid.UUID,
    principal: Principal,
    expected: int | None,
    *,
    retry: bool,
) -> Allocation:
    return await commit_change(
        kit,
        response,
        lambda session: service.release_allocation(
            session, principal, allocation_id, retry=retry, expected_version=expected
        ),
    )


@_allocation_read("/allocations/{allocation_id}/timeline", list[TimelineEntry])
async def get_timeline(
    kit: Kit, allocation_id: uuid.UUID, principal: CurrentPrincipal, after: int = Query(0, ge=0)
) -> list[TimelineEntry]:
    async with kit.sessions() as session:
        return await service.read_timeline(session, principal, allocation_id, after)


@router.get(
    "/allocations/{allocation_id}/ssh-host-key",
    response_model=SshHostKey,
    tags=["ssh"],
    openapi_extra=action_doc("allocations.read"),
    description="The SSH endpoint and the host key pinned for it, with a known_hosts line: clients verify the host "
    "with it (`gpuaas alloc ssh`, the SDK). 409 `no_ssh_endpoint` before placement, `host_key_not_pinned` before "
    "the host's agent registered a key.",
)
async def get_ssh_host_key(kit: Kit, allocation_id: uuid.UUID, principal: CurrentPrincipal) -> SshHostKey:
    async with kit.sessions() as session:
        return await service.ssh_host_key(session, principal, allocation_id)


@router.get(
    "/allocations/{allocation_id}/timeline/stream",
    tags=["allocations"],
    description="Server-sent events: every timeline entry (`event: timeline`), then new ones as they "
    "happen. `?access_token=` is accepted for browsers.",
    openapi_extra=action_doc("allocations.read"),
)
async def stream_timeline(
    kit: Kit, request: Request, allocation_id: uuid.UUID, principal: CurrentPrincipal, after: int = Query(0, ge=0)
) -> EventSourceResponse:
    async with kit.sessions() as session:
        entries = await service.read_timeline(session, principal, allocation_id, after)

    async def events() -> AsyncIterator[dict[str, Any]]:
        nonlocal entries
        last = after
        while True:
            for e in entries:
                last = e.seq
                yield {"event": "timeline", "id": str(e.seq), "data": json.dumps(e.model_dump(mode="json"))}
            if await request.is_disconnected():
                return
            await asyncio.sleep(0.5)
            async with kit.sessions() as session:
                entries = await service.timeline_entries(session, allocation_id, last)

    async def still_readable() -> None:
        async with kit.sessions() as session:  # authorizes against the projection; reads no entry
            await service.read_timeline(session, principal, allocation_id, 2**62)

    if kit.revocations is None:
        return EventSourceResponse(events(), ping=15)
    # Ends with `event: access_revoked` once the viewer loses access (revocation event or token expiry).
    lost = revocation.until_access_lost(kit.revocations, principal, still_readable)
    return EventSourceResponse(revocation.guarded(events(), lost, revocation.sse_refusal), ping=15)


def _storage_route(
    method: str, path: str, action: str, response_model: object = Volume, status_code: int | None = None
) -> Callable[[DecoratedCallable], DecoratedCallable]:
    return router.api_route(
        path,
        methods=[method],
        response_model=response_model,
        status_code=status_code,
        tags=["storage"],
        openapi_extra=action_doc(action),
    )


# ---------------------------------------------------------------------------------------------- SSH keys


@router.post("/ssh-keys", response_model=SshKey, status_code=201, tags=["ssh"])
async def add_key(kit: Kit, body: SshKeyCreate, principal: CurrentPrincipal) -> SshKey:
    async with kit.sessions() as session, session.begin():
        return await service.add_ssh_key(session, principal, name=body.name, public_key=body.public_key)


@router.get("/ssh-keys", response_model=list[SshKey], tags=["ssh"])
async def list_keys(kit: Kit, principal: CurrentPrincipal) -> list[SshKey]:
    async with kit.sessions() as session:
        return await service.list_ssh_keys(session, principal)


@router.delete("/ssh-keys/{key_id}", status_code=204, tags=["ssh"])
async def delete_key(kit: Kit, key_id: uuid.UUID, principal: CurrentPrincipal) -> Response:
    async with kit.sessions() as session, session.begin():
        await service.delete_ssh_key(session, principal, key_id)
    return Response(status_code=204)


@router.post("/allocations/{allocation_id}/ssh-grants", response_model=SshGrantState, status_code=201, tags=["ssh"])
async def create_grant(
    kit: Kit,
    response: Response,
    allocation_id: uuid.UUID,
    body: GrantCreate,
    principal: CurrentPrincipal,
    expected: ExpectedVersion,
) -> SshGrantState:
    """`If-Match` and the answered `ETag` are the allocation's version (a grant does not change it)."""
    return await commit_change(
        kit,
        response,
        lambda session: service.create_grant(
            session,
            principal,
            allocation_id,
            user_id=body.user_id,
            public_key=body.public_key,
            expected_version=expected,
        ),
    )


@router.get(
    "/allocations/{allocation_id}/ssh-grants",
    response_model=list[SshGrantState],
    tags=["ssh"],
    openapi_extra=action_doc("allocations.read"),
)
async def list_grants(kit: Kit, allocation_id: uuid.UUID, principal: CurrentPrincipal) -> list[SshGrantState]:
    async with kit.sessions() as session:
        return await service.list_grants(session, principal, allocation_id)


@router.delete("/allocations/{allocation_id}/ssh-grants/{grant_id}", response_model=SshGrantState, tags=["ssh"])
async def revoke_grant(
    kit: Kit,
    response: Response,
    allocation_id: uuid.UUID,
    grant_id: uuid.UUID,
    principal: CurrentPrincipal,
    expected: ExpectedVersion,
) -> SshGrantState:
    """`If-Match` and the answered `ETag` are the allocation's version (a grant does not change it)."""
    return await commit_change(
        kit,
        response,
        lambda session: service.revoke_grant(session, principal, allocation_id, grant_id, expected_version=expected),
    )


# ----------------------------------------------------------------------------------------------- volumes


@_storage_route("POST", "/projects/{project_id}/volumes", "allocations.volume.manage", status_code=201)
async def create_volume(kit: Kit, project_id: uuid.UUID, body: VolumeCreate, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        state = await service.create_volume(
            session,
            principal,
            project_id,
            name=body.name,
            size_gb=body.size_gb,
            persist=body.persist,
            access_mode=body.access_mode,
        )
    return volume_view(state)


@_storage_route("GET", "/projects/{project_id}/volumes", "allocations.read", response_model=list[Volume])
async def list_volumes(kit: Kit, project_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session:
        return [volume_view(v) for v in await service.list_volumes(session, principal, project_id)]


@_storage_route("GET", "/volumes/{volume_id}", "allocations.read")
async def get_volume(kit: Kit, volume_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session:
        return volume_view(await service.get_volume(session, principal, volume_id))


@_storage_route("DELETE", "/volumes/{volume_id}", "allocations.volume.manage")
async def delete_volume(kit: Kit, volume_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        state = await service.delete_volume(session, principal, volume_id)
    return volume_view(state)


@_storage_route("POST", "/allocations/{allocation_id}/volumes", "allocations.update", status_code=201)
async def attach(
    kit: Kit,
    response: Response,
    allocation_id: uuid.UUID,
    body: AttachBody,
    principal: CurrentPrincipal,
    expected: ExpectedVersion,
) -> Any:
    """`If-Match` and the answered `ETag` are the allocation's version, which the attachment moves on."""
    state = await commit_change(
        kit,
        response,
        lambda session: service.attach_volume(
            session, principal, allocation_id, body.volume_id, expected_version=expected
        ),
    )
    return volume_view(state)


@_storage_route("DELETE", "/allocations/{allocation_id}/volumes/{volume_id}", "allocations.update")
async def detach(
    kit: Kit,
    response: Response,
    allocation_id: uuid.UUID,
    volume_id: uuid.UUID,
    principal: CurrentPrincipal,
    expected: ExpectedVersion,
) -> Any:
    """`If-Match` and the answered `ETag` are the allocation's version, which the detachment moves on."""
    state = await commit_change(
        kit,
        response,
        lambda session: service.detach_volume(session, principal, allocation_id, volume_id, expected_version=expected),
    )
    return volume_view(state)


# ------------------------------------------------------------------------------------------------ quotas


@router.put(
    "/projects/{project_id}/quota",
    response_model=Quota,
    tags=["quotas"],
    openapi_extra=action_doc("allocations.quota.manage"),
)
async def set_quota(kit: Kit, project_id: uuid.UUID, body: QuotaBody, principal: CurrentPrincipal) -> Quota:
    async with kit.sessions() as session, session.begin():
        return await service.set_quota(session, principal, project_id, body.max_gpus)


@router.get(
    "/projects/{project_id}/quota", response_model=Quota, tags=["quotas"], openapi_extra=action_doc("allocations.read")
)
async def get_quota(kit: Kit, project_id: uuid.UUID, principal: CurrentPrincipal) -> Quota:
    async with kit.sessions() as session:
        return await service.get_quota(session, principal, project_id)
