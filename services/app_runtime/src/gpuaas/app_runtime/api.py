"""App-runtime's HTTP surface (thin: validation here, rules in service.py, one transaction per request).

Two audiences:
- users (JWT of a person): deploy, inspect, operate and decommission instances; the timeline (SSE);
- controllers (JWT of a project service account with the `app-controller` scope, bound to the app in
  that project): `/controller/...` to list desired state, claim operations with a lease, report, and fetch
  the instance's access credential.

Optimistic concurrency (ARCHITECTURE §11): `GET /instances/{id}` answers the instance's `version` as its
ETag. The instance's mutations (stop/start, decommission, upgrade/rollback, operation requests) take an
optional If-Match with it, the operator actions on an operation (retry/cancel/force-fail) the operation's;
a version that moved on is 412 `version_mismatch`. Every mutation answers the resource it returns with
its new ETag (an operation request: the new operation's). Without If-Match nothing is checked.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from sse_starlette.sse import EventSourceResponse

from gpuaas.app_runtime import service
from gpuaas.app_runtime.custody import Custody, generate_key_pair
from gpuaas.app_runtime.models import credentials, instance_events, instances, members, operations
from gpuaas.contracts import new_event_id
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events.app_runtime import (
    DecommissionReport,
    InstanceHealth,
    MemberStatus,
    OperationKind,
    OperationStatus,
    PlacementIntent,
)
from gpuaas.kit import iam
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.auth import CurrentPrincipal, Principal, current_principal
from gpuaas.kit.errors import Forbidden, NotFound, Unprocessable
from gpuaas.kit.versioning import IfMatch, expected_version, set_etag

router = APIRouter()
SLUG = r"^[a-z0-9][a-z0-9-]*$"
PRECONDITION = {412: {"description": "`version_mismatch`: If-Match names a version the resource has moved on from"}}
JsonObject = dict[str, Any]
T = TypeVar("T")


def kit_of(request: Request) -> KitRuntime:
    return request.app.state.kit


def custody_of(request: Request) -> Custody:
    return kit_of(request).extras["custody"]


# ------------------------------------------------------------------------------------------ schemas


class Instance(BaseModel):
    instance_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    name: str
    app_slug: str
    app_version: str
    manifest_id: uuid.UUID
    artifact_digest: str
    status: InstanceStatus
    status_changed_at: datetime
    placement_intent: PlacementIntent
    config: JsonObject
    runtime_detail: JsonObject
    health: InstanceHealth
    failure_reason: str | None
    decommission: DecommissionReport | None
    desired_manifest_id: uuid.UUID | None
    desired_app_version: str | None
    previous_manifest_id: uuid.UUID | None
    version: int
    created_at: datetime


class Member(BaseModel):
    member_id: uuid.UUID
    instance_id: uuid.UUID
    component_key: str
    allocation_id: uuid.UUID
    status: MemberStatus
    status_changed_at: datetime
    last_operation_id: uuid.UUID | None
    detail: JsonObject
    tombstoned: bool
    tombstone_reason: str | None
    version: int


class Operation(BaseModel):
    operation_id: uuid.UUID
    instance_id: uuid.UUID
    project_id: uuid.UUID
    app_slug: str
    kind: OperationKind
    status: OperationStatus
    member_id: uuid.UUID | None
    result_member_id: uuid.UUID | None
    component_key: str | None
    allocation_id: uuid.UUID | None
    params: JsonObject
    claimed_by: str | None
    lease_expires_at: datetime | None
    attempt: int
    progress_message: str
    progress_percent: int | None
    error: str | None
    forced: bool
    result: JsonObject
    version: int
    created_at: datetime
    updated_at: datetime


class TimelineEntry(BaseModel):
    seq: int
    instance_id: uuid.UUID
    kind: str
    message: str
    data: JsonObject
    actor: str | None
    occurred_at: datetime


class Page(BaseModel, Generic[T]):
    items: list[T]


class CredentialPublic(BaseModel):
    """The public half only: the private key is delivered to the instance's controller and nowhere else."""

    credential_id: uuid.UUID
    instance_id: uuid.UUID
    public_key: str
    fingerprint: str
    custody: str
    status: str
    allocation_ids: list[uuid.UUID]
    rotated_from: uuid.UUID | None
    created_at: datetime


class CredentialSecret(CredentialPublic):
    private_key: str = Field(description="OpenSSH private key; keep it in memory, never log it")


class DeployRequest(BaseModel):
    name: str = Field(min_length=1, max_length=100)
    app_slug: str = Field(pattern=SLUG, max_length=100)
    app_version: str | None = Field(default=None, max_length=100, description="default: the latest active version")
    config: JsonObject = Field(default_factory=dict)
    placement_intent: PlacementIntent


class OperationRequest(BaseModel):
    kind: OperationKind
    member_id: uuid.UUID | None = None
    allocation_id: uuid.UUID | None = None
    component_key: str | None = Field(default=None, max_length=100)
    params: JsonObject = Field(default_factory=dict)


class Reason(BaseModel):
    reason: str = Field("", max_length=2000)


class VersionChange(BaseModel):
    app_version: str = Field(min_length=1, max_length=100)


class ControllerBinding(BaseModel):
    service_account_id: uuid.UUID


class ControllerBindingOut(BaseModel):
    binding_id: uuid.UUID
    project_id: uuid.UUID
    app_slug: str
    service_account_id: uuid.UUID


class ClaimRequest(BaseModel):
    app_slug: str = Field(pattern=SLUG, max_length=100)
    operation_id: uuid.UUID | None = Field(default=None, description="a given operation; default: the oldest claimable")
    lease_s: int | None = Field(default=None, ge=5, le=3600)
    holder: str | None = Field(default=None, max_length=200, description="which controller replica (for the timeline)")


class Claim(BaseModel):
    operation: Operation
    lease_token: uuid.UUID
    lease_expires_at: datetime


class Heartbeat(BaseModel):
    lease_token: uuid.UUID
    lease_s: int | None = Field(default=None, ge=5, le=3600)
    message: str | None = Field(default=None, max_length=2000)
    percent: int | None = Field(default=None, ge=0, le=100)


class Completion(BaseModel):
    lease_token: uuid.UUID
    result: JsonObject = Field(default_factory=dict, description="e.g. {teardown_verified: true, evidence: '...'}")
    member_detail: JsonObject | None = None


class Failure(BaseModel):
    lease_token: uuid.UUID
    error: str = Field(min_length=1, max_length=4000)


class InstanceReport(BaseModel):
    status: Literal["running", "degraded", "failed"] | None = None
    health: InstanceHealth | None = None
    runtime_detail: JsonObject | None = None
    app_version: str | None = Field(default=None, description="the version now rolled out (after an upgrade)")


class MemberReport(BaseModel):
    status: Literal["active", "failed"] | None = None
    detail: JsonObject | None = None


class ControllerEvent(BaseModel):
    kind: str = Field(min_length=1, max_length=100, pattern=r"^[a-z0-9_.-]+$")
    message: str = Field("", max_length=4000)
    data: JsonObject = Field(default_factory=dict)


VersionedT = TypeVar("VersionedT", Instance, Operation)


def _versioned(response: Response, view: VersionedT) -> VersionedT:
    """The view, with its version as the response's ETag."""
    set_etag(response, view.version)
    return view


class VersionedChange:
    """A mutation's unit of work (a dependency): runs the use case in one transaction with the version the
    request's If-Match names, which the use case checks under its row lock (412 `version_mismatch`), and
    answers the changed resource with its new ETag. A malformed If-Match is 422 before any database work."""

    def __init__(self, request: Request, response: Response, if_match: IfMatch = None) -> None:
        self.request, self.response = request, response
        self.expected = expected_version(if_match)

    async def __call__(
        self, view: Callable[[Any], VersionedT], use_case: Callable[[AsyncSession, int | None], Awaitable[Any]]
    ) -> VersionedT:
        async with kit_of(self.request).sessions() as session, session.begin():
            row = await use_case(session, self.expected)
        return _versioned(self.response, view(row))


Change = Annotated[VersionedChange, Depends()]


def _instance(row: Any) -> Instance:
    return Instance.model_validate(dict(row._mapping))


def _op(row: Any) -> Operation:
    return Operation.model_validate(dict(row._mapping))


def _member(row: Any) -> Member:
    return Member.model_validate(dict(row._mapping))


def _cred(row: Any, cls: type[CredentialPublic] = CredentialPublic, **extra: Any) -> Any:
    return cls.model_validate({**dict(row._mapping), **extra})


def _lease_s(request: Request, wanted: int | None) -> int:
    s = kit_of(request).settings
    return min(wanted or s.lease_default_s, s.lease_max_s)  # type: ignore[attr-defined]


def _controller_project(principal: Principal) -> uuid.UUID:
    if not principal.is_service_account or principal.project_id is None:
        raise Forbidden("the controller API is for project service accounts", code="controller_only")
    return principal.project_id


# ------------------------------------------------------------------------------------------ user API


@router.put(
    "/projects/{project_id}/controllers/{app_slug}",
    response_model=ControllerBindingOut,
    tags=["controllers"],
    openapi_extra=iam.action_doc("apps.instance.manage"),
)
async def bind_controller(
    project_id: uuid.UUID, app_slug: str, body: ControllerBinding, principal: CurrentPrincipal, request: Request
) -> Any:
    """Make a service account (scope `app-controller`) the controller of an app in this project."""
    async with kit_of(request).sessions() as session, session.begin():
        row = await service.bind_controller(session, principal, project_id, app_slug, body.service_account_id)
    return dict(row._mapping)


@router.post(
    "/projects/{project_id}/instances",
    response_model=Instance,
    status_code=201,
    tags=["instances"],
    openapi_extra=iam.action_doc("apps.instance.deploy"),
)
async def deploy(project_id: uuid.UUID, body: DeployRequest, principal: CurrentPrincipal, request: Request) -> Any:
    """Deploy an app: checks entitlement, manifest state, placement, compatibility and the inputs schema."""
    async with kit_of(request).sessions() as session:  # cheap refusal before any key is made
        await iam.authorize(session, principal, "apps.instance.deploy", project_id=project_id)
    credential_id = new_event_id()
    key_pair = generate_key_pair(f"gpuaas-app-{credential_id}")
    sealed = await custody_of(request).seal(credential_id, key_pair.private_openssh)
    async with kit_of(request).sessions() as session, session.begin():
        row = await service.deploy(
            session,
            principal,
            project_id,
            name=body.name,
            app_slug=body.app_slug,
            app_version=body.app_version,
            config=body.config,
            placement=body.placement_intent,
            credential_id=credential_id,
            key_pair=key_pair,
            sealed=sealed,
        )
    return _instance(row)


@router.get("/instances", response_model=Page[Instance], tags=["instances"])
async def list_instances(
    principal: CurrentPrincipal,
    request: Request,
    project_id: uuid.UUID | None = None,
    app_slug: str | None = None,
    status: InstanceStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> Any:
    async with kit_of(request).sessions() as session:
        visible = await iam.visible_project_ids(session, principal)
        stmt = select(instances)
        if visible is not None:
            stmt = stmt.where(instances.c.project_id.in_(list(visible)))
        if project_id is not None:
            stmt = stmt.where(instances.c.project_id == project_id)
        if app_slug is not None:
            stmt = stmt.where(instances.c.app_slug == app_slug)
        if status is not None:
            stmt = stmt.where(instances.c.status == status)
        rows = (await session.execute(stmt.order_by(instances.c.instance_id.desc()).limit(limit))).all()
    return {"items": [_instance(r) for r in rows]}


@router.get(
    "/instances/{instance_id}",
    response_model=Instance,
    tags=["instances"],
    openapi_extra=iam.action_doc("apps.instance.read"),
)
async def get_instance(
    instance_id: uuid.UUID, principal: CurrentPrincipal, request: Request, response: Response
) -> Any:
    """The instance; `ETag` is its version, for If-Match on the instance's mutations."""
    async with kit_of(request).sessions() as session:
        return _versioned(response, _instance(await service.readable_instance(session, principal, instance_id)))


@router.get(
    "/instances/{instance_id}/members",
    response_model=Page[Member],
    tags=["instances"],
    openapi_extra=iam.action_doc("apps.instance.read"),
)
async def list_members(
    instance_id: uuid.UUID, principal: CurrentPrincipal, request: Request, include_tombstones: bool = False
) -> Any:
    async with kit_of(request).sessions() as session:
        await service.readable_instance(session, principal, instance_id)
        stmt = select(members).where(members.c.instance_id == instance_id)
        if not include_tombstones:
            stmt = stmt.where(members.c.tombstoned.is_(False))
        rows = (await session.execute(stmt.order_by(members.c.created_at, members.c.member_id))).all()
    return {"items": [_member(r) for r in rows]}


@router.get(
    "/instances/{instance_id}/operations",
    response_model=Page[Operation],
    tags=["operations"],
    openapi_extra=iam.action_doc("apps.instance.read"),
)
async def list_operations(instance_id: uuid.UUID, principal: CurrentPrincipal, request: Request) -> Any:
    async with kit_of(request).sessions() as session:
        await service.readable_instance(session, principal, instance_id)
        rows = (
            await session.execute(
                select(operations).where(operations.c.instance_id == instance_id).order_by(operations.c.operation_id)
            )
        ).all()
    return {"items": [_op(r) for r in rows]}


@router.post(
    "/instances/{instance_id}/operations",
    response_model=Operation,
    status_code=201,
    tags=["operations"],
    responses=PRECONDITION,
)
async def request_operation(
    instance_id: uuid.UUID, body: OperationRequest, principal: CurrentPrincipal, change: Change
) -> Any:
    """Ask for a member operation. If-Match names the instance's version (a request moves it on); the
    answer is the new operation, its `ETag` the operation's version (for retry/cancel/force-fail)."""
    return await change(_op, _operation_request(principal, instance_id, body))


def _operation_request(
    principal: Principal, instance_id: uuid.UUID, body: OperationRequest
) -> Callable[[AsyncSession, int | None], Awaitable[Any]]:
    def use_case(session: AsyncSession, expected: int | None) -> Awaitable[Any]:
        return service.request_operation(
            session,
            principal,
            instance_id,
            body.kind,
            member_id=body.member_id,
            allocation_id=body.allocation_id,
            component_key=body.component_key,
            params=body.params,
            expected_version=expected,
        )

    return use_case


@router.get(
    "/instances/{instance_id}/events",
    response_model=Page[TimelineEntry],
    tags=["timeline"],
    openapi_extra=iam.action_doc("apps.instance.read"),
)
async def timeline(
    instance_id: uuid.UUID,
    principal: CurrentPrincipal,
    request: Request,
    after: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 500,
) -> Any:
    async with kit_of(request).sessions() as session:
        await service.readable_instance(session, principal, instance_id)
        rows = await _timeline_rows(session, instance_id, after, limit)
    return {"items": [TimelineEntry.model_validate(dict(r._mapping)) for r in rows]}


async def _timeline_rows(session: Any, instance_id: uuid.UUID, after: int, limit: int) -> list[Any]:
    return list(
        (
            await session.execute(
                select(instance_events)
                .where(instance_events.c.instance_id == instance_id, instance_events.c.seq > after)
                .order_by(instance_events.c.seq)
                .limit(limit)
            )
        ).all()
    )


@router.get(
    "/instances/{instance_id}/events/stream", tags=["timeline"], openapi_extra=iam.action_doc("apps.instance.read")
)
async def timeline_stream(
    instance_id: uuid.UUID,
    request: Request,
    after: Annotated[int, Query(ge=0)] = 0,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> EventSourceResponse:
    """Server-sent events of the instance timeline (`id` = seq; reconnects resume with Last-Event-ID)."""
    principal = await current_principal(request)
    kit = kit_of(request)
    async with kit.sessions() as session:
        await service.readable_instance(session, principal, instance_id)
    cursor = after
    if last_event_id and last_event_id.isdigit():
        cursor = max(cursor, int(last_event_id))
    interval = kit.settings.sse_poll_interval_s  # type: ignore[attr-defined]

    async def events() -> Any:
        nonlocal cursor
        while not await request.is_disconnected():
            async with kit.sessions() as session:
                rows = await _timeline_rows(session, instance_id, cursor, 200)
            for r in rows:
                cursor = r.seq
                entry = TimelineEntry.model_validate(dict(r._mapping))
                yield {"id": str(r.seq), "event": r.kind, "data": entry.model_dump_json()}
            if not rows:
                await asyncio.sleep(interval)

    return EventSourceResponse(events(), ping=10, headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


@router.post(
    "/instances/{instance_id}/stop",
    response_model=Instance,
    tags=["instances"],
    openapi_extra=iam.action_doc("apps.instance.manage"),
    responses=PRECONDITION,
)
async def stop(instance_id: uuid.UUID, principal: CurrentPrincipal, change: Change) -> Any:
    return await change(_instance, lambda s, v: service.stop(s, principal, instance_id, expected_version=v))


@router.post(
    "/instances/{instance_id}/start",
    response_model=Instance,
    tags=["instances"],
    openapi_extra=iam.action_doc("apps.instance.manage"),
    responses=PRECONDITION,
)
async def start(instance_id: uuid.UUID, principal: CurrentPrincipal, change: Change) -> Any:
    return await change(_instance, lambda s, v: service.start(s, principal, instance_id, expected_version=v))


@router.post(
    "/instances/{instance_id}/decommission",
    response_model=Instance,
    tags=["instances"],
    openapi_extra=iam.action_doc("apps.instance.manage"),
    responses=PRECONDITION,
)
async def decommission(instance_id: uuid.UUID, body: Reason, principal: CurrentPrincipal, change: Change) -> Any:
    """Tear down every member; `decommissioned` only after the controller verifies each teardown.
    Also retries a `decommission_failed` instance."""
    return await change(
        _instance, lambda s, v: service.decommission(s, principal, instance_id, body.reason, expected_version=v)
    )


@router.post(
    "/instances/{instance_id}/decommission/force",
    response_model=Instance,
    tags=["instances"],
    openapi_extra=iam.action_doc("apps.instance.manage"),
    responses=PRECONDITION,
)
async def force_decommission(instance_id: uuid.UUID, body: Reason, principal: CurrentPrincipal, change: Change) -> Any:
    """Complete a failed/stuck decommission without verification: recorded as forced, with the reason."""
    return await change(
        _instance, lambda s, v: service.force_decommission(s, principal, instance_id, body.reason, expected_version=v)
    )


@router.post(
    "/instances/{instance_id}/upgrade",
    response_model=Instance,
    tags=["instances"],
    openapi_extra=iam.action_doc("apps.instance.manage"),
    responses=PRECONDITION,
)
async def upgrade(instance_id: uuid.UUID, body: VersionChange, principal: CurrentPrincipal, change: Change) -> Any:
    """Set the desired app version; the instance's controller rolls it out and reports it."""
    return await change(
        _instance, lambda s, v: service.upgrade(s, principal, instance_id, body.app_version, expected_version=v)
    )


@router.post(
    "/instances/{instance_id}/rollback",
    response_model=Instance,
    tags=["instances"],
    openapi_extra=iam.action_doc("apps.instance.manage"),
    responses=PRECONDITION,
)
async def rollback(instance_id: uuid.UUID, principal: CurrentPrincipal, change: Change) -> Any:
    return await change(
        _instance, lambda s, v: service.upgrade(s, principal, instance_id, None, rollback=True, expected_version=v)
    )


@router.get(
    "/instances/{instance_id}/credential",
    response_model=CredentialPublic,
    tags=["credentials"],
    openapi_extra=iam.action_doc("apps.instance.read"),
)
async def credential_public(instance_id: uuid.UUID, principal: CurrentPrincipal, request: Request) -> Any:
    async with kit_of(request).sessions() as session:
        await service.readable_instance(session, principal, instance_id)
        row = (
            await session.execute(
                select(credentials).where(credentials.c.instance_id == instance_id, credentials.c.status == "active")
            )
        ).first()
    if row is None:
        raise NotFound("the instance has no active access credential", code="credential_not_found")
    return _cred(row)


@router.post(
    "/instances/{instance_id}/credential/rotate",
    response_model=CredentialPublic,
    tags=["credentials"],
    openapi_extra=iam.action_doc("apps.credential.rotate"),
)
async def rotate_credential(instance_id: uuid.UUID, principal: CurrentPrincipal, request: Request) -> Any:
    async with kit_of(request).sessions() as session:
        await service.authorized_instance(session, principal, instance_id, "apps.credential.rotate", lock=False)
    credential_id = new_event_id()
    key_pair = generate_key_pair(f"gpuaas-app-{credential_id}")
    sealed = await custody_of(request).seal(credential_id, key_pair.private_openssh)
    async with kit_of(request).sessions() as session, session.begin():
        row = await service.rotate_credential(session, principal, instance_id, credential_id, key_pair, sealed)
    return _cred(row)


@router.post(
    "/operations/{operation_id}/retry",
    response_model=Operation,
    tags=["operations"],
    openapi_extra=iam.action_doc("apps.operation.manage"),
    responses=PRECONDITION,
)
async def retry_operation(operation_id: uuid.UUID, body: Reason, principal: CurrentPrincipal, change: Change) -> Any:
    """If-Match names the operation's version (`version` in its listing, or a previous answer's ETag)."""
    return await change(
        _op, lambda s, v: service.retry_operation(s, principal, operation_id, body.reason, expected_version=v)
    )


@router.post(
    "/operations/{operation_id}/cancel",
    response_model=Operation,
    tags=["operations"],
    openapi_extra=iam.action_doc("apps.operation.manage"),
    responses=PRECONDITION,
)
async def cancel_operation(operation_id: uuid.UUID, body: Reason, principal: CurrentPrincipal, change: Change) -> Any:
    """If-Match names the operation's version (`version` in its listing, or a previous answer's ETag)."""
    return await change(
        _op, lambda s, v: service.cancel_operation(s, principal, operation_id, body.reason, expected_version=v)
    )


@router.post(
    "/operations/{operation_id}/force-fail",
    response_model=Operation,
    tags=["operations"],
    openapi_extra=iam.action_doc("apps.operation.manage"),
    responses=PRECONDITION,
)
async def force_fail_operation(
    operation_id: uuid.UUID, body: Reason, principal: CurrentPrincipal, change: Change
) -> Any:
    if not body.reason.strip():
        raise Unprocessable("force-fail needs a reason", code="reason_required")
    return await change(
        _op, lambda s, v: service.force_fail_operation(s, principal, operation_id, body.reason, expected_version=v)
    )


# ------------------------------------------------------------------------------------------ controller API


@router.get("/controller/instances", response_model=Page[Instance], tags=["controller"])
async def controller_instances(
    principal: CurrentPrincipal,
    request: Request,
    app_slug: Annotated[str, Query(pattern=SLUG)],
    include_final: bool = False,
) -> Any:
    """Desired state of every instance of this controller's app in its project."""
    project_id = _controller_project(principal)
    async with kit_of(request).sessions() as session:
        await service.check_controller(session, principal, project_id, app_slug)
        stmt = select(instances).where(instances.c.project_id == project_id, instances.c.app_slug == app_slug)
        if not include_final:
            stmt = stmt.where(instances.c.status != InstanceStatus.decommissioned)
        rows = (await session.execute(stmt.order_by(instances.c.instance_id))).all()
    return {"items": [_instance(r) for r in rows]}


@router.get("/controller/instances/{instance_id}/members", response_model=Page[Member], tags=["controller"])
async def controller_members(instance_id: uuid.UUID, principal: CurrentPrincipal, request: Request) -> Any:
    async with kit_of(request).sessions() as session:
        await service.controller_instance(session, principal, instance_id)
        rows = (
            await session.execute(
                select(members).where(members.c.instance_id == instance_id).order_by(members.c.created_at)
            )
        ).all()
    return {"items": [_member(r) for r in rows]}


@router.get("/controller/operations", response_model=Page[Operation], tags=["controller"])
async def controller_operations(
    principal: CurrentPrincipal,
    request: Request,
    app_slug: Annotated[str, Query(pattern=SLUG)],
    status: Annotated[list[OperationStatus] | None, Query()] = None,
) -> Any:
    project_id = _controller_project(principal)
    async with kit_of(request).sessions() as session:
        rows = await service.controller_operations(
            session, principal, project_id, app_slug, [s.value for s in status or []]
        )
    return {"items": [_op(r) for r in rows]}


@router.post(
    "/controller/operations/claim",
    response_model=Claim,
    tags=["controller"],
    responses={204: {"description": "nothing to claim"}},
)
async def controller_claim(body: ClaimRequest, principal: CurrentPrincipal, request: Request) -> Any:
    project_id = _controller_project(principal)
    async with kit_of(request).sessions() as session, session.begin():
        got = await service.claim(
            session,
            principal,
            project_id=project_id,
            app_slug=body.app_slug,
            operation_id=body.operation_id,
            lease_s=_lease_s(request, body.lease_s),
            holder=body.holder,
        )
    if got is None:
        return Response(status_code=204)
    op, token = got
    return {"operation": _op(op), "lease_token": token, "lease_expires_at": op.lease_expires_at}


@router.post("/controller/operations/{operation_id}/heartbeat", response_model=Operation, tags=["controller"])
async def controller_heartbeat(
    operation_id: uuid.UUID, body: Heartbeat, principal: CurrentPrincipal, request: Request
) -> Any:
    async with kit_of(request).sessions() as session, session.begin():
        return _op(
            await service.heartbeat(
                session,
                principal,
                operation_id,
                body.lease_token,
                lease_s=_lease_s(request, body.lease_s),
                message=body.message,
                percent=body.percent,
            )
        )


@router.post("/controller/operations/{operation_id}/complete", response_model=Operation, tags=["controller"])
async def controller_complete(
    operation_id: uuid.UUID, body: Completion, principal: CurrentPrincipal, request: Request
) -> Any:
    async with kit_of(request).sessions() as session, session.begin():
        return _op(
            await service.complete(session, principal, operation_id, body.lease_token, body.result, body.member_detail)
        )


@router.post("/controller/operations/{operation_id}/fail", response_model=Operation, tags=["controller"])
async def controller_fail(operation_id: uuid.UUID, body: Failure, principal: CurrentPrincipal, request: Request) -> Any:
    async with kit_of(request).sessions() as session, session.begin():
        return _op(await service.controller_fail(session, principal, operation_id, body.lease_token, body.error))


@router.post(
    "/controller/instances/{instance_id}/operations",
    response_model=Operation,
    status_code=201,
    tags=["controller"],
    responses=PRECONDITION,
)
async def controller_request_operation(
    instance_id: uuid.UUID, body: OperationRequest, principal: CurrentPrincipal, change: Change
) -> Any:
    """As `POST /instances/{instance_id}/operations`, for the instance's controller (If-Match optional)."""
    return await change(_op, _operation_request(principal, instance_id, body))


@router.put("/controller/instances/{instance_id}/status", response_model=Instance, tags=["controller"])
async def controller_report_instance(
    instance_id: uuid.UUID, body: InstanceReport, principal: CurrentPrincipal, request: Request
) -> Any:
    async with kit_of(request).sessions() as session, session.begin():
        row = await service.report_instance(
            session,
            principal,
            instance_id,
            status=body.status,
            health=body.health.model_dump(mode="json", exclude={"checked_at"}) if body.health else None,
            runtime_detail=body.runtime_detail,
            app_version=body.app_version,
        )
    return _instance(row)


@router.put("/controller/members/{member_id}/status", response_model=Member, tags=["controller"])
async def controller_report_member(
    member_id: uuid.UUID, body: MemberReport, principal: CurrentPrincipal, request: Request
) -> Any:
    async with kit_of(request).sessions() as session, session.begin():
        return _member(
            await service.report_member(session, principal, member_id, status=body.status, detail=body.detail)
        )


@router.post(
    "/controller/instances/{instance_id}/events", response_model=TimelineEntry, status_code=201, tags=["controller"]
)
async def controller_event(
    instance_id: uuid.UUID, body: ControllerEvent, principal: CurrentPrincipal, request: Request
) -> Any:
    """Add an adapter event (e.g. `slurm.partition_ready`) to the instance timeline."""
    async with kit_of(request).sessions() as session, session.begin():
        await service.controller_instance(session, principal, instance_id)
        await service.timeline(
            session, instance_id, f"controller.{body.kind}", body.message, principal.actor, **body.data
        )
        row = (
            await session.execute(
                select(instance_events)
                .where(instance_events.c.instance_id == instance_id)
                .order_by(instance_events.c.seq.desc())
                .limit(1)
            )
        ).one()
    return TimelineEntry.model_validate(dict(row._mapping))


@router.get("/controller/instances/{instance_id}/credential", response_model=CredentialSecret, tags=["controller"])
async def controller_credential(
    instance_id: uuid.UUID, principal: CurrentPrincipal, request: Request, response: Response
) -> Any:
    """The instance's SSH private key, for its controller only (audited; never cached)."""
    async with kit_of(request).sessions() as session, session.begin():
        row = await service.credential_for_controller(session, principal, instance_id)
    private_key = await custody_of(request).open(row.credential_id, row)
    response.headers["Cache-Control"] = "no-store"
    return _cred(row, CredentialSecret, private_key=private_key)
