"""The users' API (JWT of a person): bind an app's controller, deploy, inspect, operate and decommission
instances, follow their timeline (SSE), read and rotate their access credential.

Optimistic concurrency (ARCHITECTURE §11): `GET /instances/{id}` answers the instance's `version` as its
ETag. The instance's mutations (stop/start, decommission, upgrade/rollback, operation requests) take an
optional If-Match with it; a version that moved on is 412 `version_mismatch`. Every mutation answers the
resource it returns with its new ETag (an operation request: the new operation's). Without If-Match
nothing is checked.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.types import DecoratedCallable
from sse_starlette.sse import EventSourceResponse

from gpuaas.app_runtime import service
from gpuaas.app_runtime.api.calls import change, read, versioned, versioned_call
from gpuaas.app_runtime.api.schemas import (
    PRECONDITION,
    ControllerBinding,
    ControllerBindingOut,
    CredentialPublic,
    DeployRequest,
    Instance,
    Member,
    Operation,
    OperationRequest,
    Page,
    Reason,
    TimelineEntry,
    VersionChange,
)
from gpuaas.app_runtime.runtime import AppRuntimeState
from gpuaas.app_runtime.service import (
    ControllerBindingView,
    CredentialView,
    InstanceView,
    MemberView,
    OperationView,
    TimelineEntryView,
)
from gpuaas.app_runtime.settings import Settings
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.kit import iam, revocation
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal, current_principal
from gpuaas.kit.paging import PageRequest, page_params, set_next_link
from gpuaas.kit.versioning import ExpectedVersion

router = APIRouter()


def _instance_read(path: str, response_model: object, tag: str) -> Callable[[DecoratedCallable], DecoratedCallable]:
    """A GET of what an instance's readers may see."""
    return router.get(
        path, response_model=response_model, tags=[tag], openapi_extra=iam.action_doc("apps.instance.read")
    )


def _instance_change(path: str) -> Callable[[DecoratedCallable], DecoratedCallable]:
    """A POST changing an instance (If-Match: its version), answering the instance with its new ETag."""
    return router.post(
        path,
        response_model=Instance,
        tags=["instances"],
        openapi_extra=iam.action_doc("apps.instance.manage"),
        responses=PRECONDITION,
    )


@router.put(
    "/projects/{project_id}/controllers/{app_slug}",
    response_model=ControllerBindingOut,
    tags=["controllers"],
    openapi_extra=iam.action_doc("apps.instance.manage"),
)
async def bind_controller(
    project_id: uuid.UUID, app_slug: str, body: ControllerBinding, principal: CurrentPrincipal, kit: Kit
) -> ControllerBindingView:
    """Make a service account (scope `app-controller`) the controller of an app in this project."""
    return await change(
        kit, lambda session: service.bind_controller(session, principal, project_id, app_slug, body.service_account_id)
    )


@router.post(
    "/projects/{project_id}/instances",
    response_model=Instance,
    status_code=201,
    tags=["instances"],
    openapi_extra=iam.action_doc("apps.instance.deploy"),
)
async def deploy(project_id: uuid.UUID, body: DeployRequest, principal: CurrentPrincipal, kit: Kit) -> InstanceView:
    """Deploy an app: checks entitlement, manifest state, placement, compatibility and the inputs schema."""
    async with kit.sessions() as session:  # cheap refusal before any key is made
        await service.authorize_deploy(session, principal, project_id)
    credential = await service.issue_credential(kit.state_as(AppRuntimeState).custody)  # outside the transaction
    async with kit.sessions() as session, session.begin():
        return await service.deploy(
            session,
            principal,
            project_id,
            name=body.name,
            app_slug=body.app_slug,
            app_version=body.app_version,
            config=body.config,
            placement=body.placement_intent,
            credential=credential,
        )


_INSTANCE_PAGE = Depends(page_params(default=100, maximum=500))


@router.get("/instances", response_model=Page[Instance], tags=["instances"])
async def list_instances(
    principal: CurrentPrincipal,
    kit: Kit,
    request: Request,
    response: Response,
    project_id: uuid.UUID | None = None,
    app_slug: str | None = None,
    status: InstanceStatus | None = None,
    page: PageRequest = _INSTANCE_PAGE,
) -> dict[str, list[InstanceView]]:
    """Newest first; `?limit=&cursor=` pages (`Link: <...>; rel="next"` while more follow)."""
    async with kit.sessions() as session:
        items, next_cursor = await service.list_instances(
            session, principal, project_id=project_id, app_slug=app_slug, status=status, page=page
        )
    set_next_link(request, response, next_cursor)
    return {"items": items}


@_instance_read("/instances/{instance_id}", Instance, "instances")
async def get_instance(
    instance_id: uuid.UUID, principal: CurrentPrincipal, kit: Kit, response: Response
) -> InstanceView:
    """The instance; `ETag` is its version, for If-Match on the instance's mutations."""
    return versioned(
        response, await read(kit, lambda session: service.readable_instance(session, principal, instance_id))
    )


@_instance_read("/instances/{instance_id}/members", Page[Member], "instances")
async def list_members(
    instance_id: uuid.UUID, principal: CurrentPrincipal, kit: Kit, include_tombstones: bool = False
) -> dict[str, list[MemberView]]:
    async with kit.sessions() as session:
        items = await service.list_members(session, principal, instance_id, include_tombstones=include_tombstones)
    return {"items": items}


@_instance_read("/instances/{instance_id}/operations", Page[Operation], "operations")
async def list_operations(
    instance_id: uuid.UUID, principal: CurrentPrincipal, kit: Kit
) -> dict[str, list[OperationView]]:
    async with kit.sessions() as session:
        return {"items": await service.list_operations(session, principal, instance_id)}


@router.post(
    "/instances/{instance_id}/operations",
    response_model=Operation,
    status_code=201,
    tags=["operations"],
    responses=PRECONDITION,
)
async def request_operation(
    instance_id: uuid.UUID,
    body: OperationRequest,
    principal: CurrentPrincipal,
    kit: Kit,
    response: Response,
    expected: ExpectedVersion,
) -> OperationView:
    """Ask for a member operation. If-Match names the instance's version (a request moves it on); the
    answer is the new operation, its `ETag` the operation's version (for retry/cancel/force-fail)."""
    # Also the controllers' `POST /controller/instances/{instance_id}/operations` (api/controllers.py): the
    # use case tells a user from the instance's controller.
    return await versioned_call(
        kit,
        response,
        service.request_operation,
        principal,
        instance_id,
        body.kind,
        member_id=body.member_id,
        allocation_id=body.allocation_id,
        component_key=body.component_key,
        params=body.params,
        expected=expected,
    )


@_instance_read("/instances/{instance_id}/events", Page[TimelineEntry], "timeline")
async def timeline(
    instance_id: uuid.UUID,
    principal: CurrentPrincipal,
    kit: Kit,
    request: Request,
    response: Response,
    after: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 500,
) -> dict[str, list[TimelineEntryView]]:
    """Oldest first after `after` (a seq); a full page carries `Link: <...after=LAST>; rel="next"`."""
    async with kit.sessions() as session:
        items = await service.timeline_entries(session, principal, instance_id, after=after, limit=limit)
    set_next_link(request, response, str(items[-1].seq) if len(items) == limit else None, param="after")
    return {"items": items}


@router.get(
    "/instances/{instance_id}/events/stream", tags=["timeline"], openapi_extra=iam.action_doc("apps.instance.read")
)
async def timeline_stream(
    instance_id: uuid.UUID,
    request: Request,
    kit: Kit,
    after: Annotated[int, Query(ge=0)] = 0,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> EventSourceResponse:
    """Server-sent events of the instance timeline (`id` = seq; reconnects resume with Last-Event-ID)."""
    principal = await current_principal(request)
    async with kit.sessions() as session:
        project_id = (await service.readable_instance(session, principal, instance_id)).project_id
    cursor = after
    if last_event_id and last_event_id.isdigit():
        cursor = max(cursor, int(last_event_id))
    interval = kit.settings_as(Settings).sse_poll_interval_s

    async def events() -> AsyncIterator[dict[str, str]]:
        nonlocal cursor
        while not await request.is_disconnected():
            async with kit.sessions() as session:
                entries = await service.timeline_since(session, instance_id, cursor, 200)
            for entry in entries:
                cursor = entry.seq
                data = TimelineEntry.model_validate(entry, from_attributes=True).model_dump_json()
                yield {"id": str(entry.seq), "event": entry.kind, "data": data}
            if not entries:
                await asyncio.sleep(interval)

    async def still_readable() -> None:
        async with kit.sessions() as session:
            await service.readable_instance(session, principal, instance_id)

    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    if kit.revocations is None:
        return EventSourceResponse(events(), ping=10, headers=headers)
    # Ends with `event: access_revoked` once the viewer loses access (revocation event or token expiry).
    lost = revocation.until_access_lost(kit.revocations, principal, still_readable, keys=[project_id])
    return EventSourceResponse(revocation.guarded(events(), lost, revocation.sse_refusal), ping=10, headers=headers)


@_instance_change("/instances/{instance_id}/stop")
async def stop(
    instance_id: uuid.UUID, principal: CurrentPrincipal, kit: Kit, response: Response, expected: ExpectedVersion
) -> InstanceView:
    return await versioned_call(kit, response, service.stop, principal, instance_id, expected=expected)


@_instance_change("/instances/{instance_id}/start")
async def start(
    instance_id: uuid.UUID, principal: CurrentPrincipal, kit: Kit, response: Response, expected: ExpectedVersion
) -> InstanceView:
    return await versioned_call(kit, response, service.start, principal, instance_id, expected=expected)


@_instance_change("/instances/{instance_id}/decommission")
async def decommission(
    instance_id: uuid.UUID,
    body: Reason,
    principal: CurrentPrincipal,
    kit: Kit,
    response: Response,
    expected: ExpectedVersion,
) -> InstanceView:
    """Tear down every member; `decommissioned` only after the controller verifies each teardown.
    Also retries a `decommission_failed` instance."""
    return await versioned_call(
        kit, response, service.decommission, principal, instance_id, body.reason, expected=expected
    )


@_instance_change("/instances/{instance_id}/decommission/force")
async def force_decommission(
    instance_id: uuid.UUID,
    body: Reason,
    principal: CurrentPrincipal,
    kit: Kit,
    response: Response,
    expected: ExpectedVersion,
) -> InstanceView:
    """Complete a failed/stuck decommission without verification: recorded as forced, with the reason."""
    return await versioned_call(
        kit, response, service.force_decommission, principal, instance_id, body.reason, expected=expected
    )


@_instance_change("/instances/{instance_id}/upgrade")
async def upgrade(
    instance_id: uuid.UUID,
    body: VersionChange,
    principal: CurrentPrincipal,
    kit: Kit,
    response: Response,
    expected: ExpectedVersion,
) -> InstanceView:
    """Set the desired app version; the instance's controller rolls it out and reports it."""
    return await versioned_call(
        kit, response, service.upgrade, principal, instance_id, body.app_version, expected=expected
    )


@_instance_change("/instances/{instance_id}/rollback")
async def rollback(
    instance_id: uuid.UUID, principal: CurrentPrincipal, kit: Kit, response: Response, expected: ExpectedVersion
) -> InstanceView:
    return await versioned_call(
        kit, response, service.upgrade, principal, instance_id, None, rollback=True, expected=expected
    )


@_instance_read("/instances/{instance_id}/credential", CredentialPublic, "credentials")
async def credential_public(instance_id: uuid.UUID, principal: CurrentPrincipal, kit: Kit) -> CredentialView:
    return await read(kit, lambda session: service.public_credential(session, principal, instance_id))


@router.post(
    "/instances/{instance_id}/credential/rotate",
    response_model=CredentialPublic,
    tags=["credentials"],
    openapi_extra=iam.action_doc("apps.credential.rotate"),
)
async def rotate_credential(instance_id: uuid.UUID, principal: CurrentPrincipal, kit: Kit) -> CredentialView:
    async with kit.sessions() as session:  # cheap refusal before any key is made
        await service.authorize_rotation(session, principal, instance_id)
    credential = await service.issue_credential(kit.state_as(AppRuntimeState).custody)  # outside the transaction
    return await change(kit, lambda session: service.rotate_credential(session, principal, instance_id, credential))
