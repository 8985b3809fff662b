"""The controllers' API (`/controller/...`, JWT of a project service account with the `app-controller`
scope, bound to the app in that project): list desired state, claim operations with a lease and report
their outcome, report instances and members, add timeline events, and fetch the instance's access
credential.
"""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Response

from gpuaas.app_runtime import service
from gpuaas.app_runtime.api.calls import change, read
from gpuaas.app_runtime.api.schemas import (
    PRECONDITION,
    SLUG,
    Claim,
    ClaimRequest,
    Completion,
    ControllerEvent,
    CredentialSecret,
    Deferral,
    Failure,
    Heartbeat,
    Instance,
    InstanceReport,
    Member,
    MemberReport,
    Operation,
    Page,
    TimelineEntry,
)
from gpuaas.app_runtime.api.users import request_operation
from gpuaas.app_runtime.runtime import AppRuntimeState
from gpuaas.app_runtime.service import (
    ClaimView,
    ControllerCredential,
    InstanceView,
    MemberView,
    OperationView,
    TimelineEntryView,
)
from gpuaas.app_runtime.settings import Settings
from gpuaas.contracts.events.app_runtime import OperationStatus
from gpuaas.kit.app import Kit, KitRuntime
from gpuaas.kit.auth import CurrentPrincipal

router = APIRouter()


def _lease_s(kit: KitRuntime, wanted: int | None) -> int:
    """The lease a controller asked for (default when it did not), capped by the settings."""
    settings = kit.settings_as(Settings)
    return min(wanted or settings.lease_default_s, settings.lease_max_s)


@router.get("/controller/instances", response_model=Page[Instance], tags=["controller"])
async def controller_instances(
    principal: CurrentPrincipal,
    kit: Kit,
    app_slug: Annotated[str, Query(pattern=SLUG)],
    include_final: bool = False,
) -> dict[str, list[InstanceView]]:
    """Desired state of every instance of this controller's app in its project."""
    items = await read(
        kit, lambda session: service.controller_instances(session, principal, app_slug, include_final=include_final)
    )
    return {"items": items}


@router.get("/controller/instances/{instance_id}/members", response_model=Page[Member], tags=["controller"])
async def controller_members(
    instance_id: uuid.UUID, principal: CurrentPrincipal, kit: Kit
) -> dict[str, list[MemberView]]:
    return {"items": await read(kit, lambda session: service.controller_members(session, principal, instance_id))}


@router.get("/controller/operations", response_model=Page[Operation], tags=["controller"])
async def controller_operations(
    principal: CurrentPrincipal,
    kit: Kit,
    app_slug: Annotated[str, Query(pattern=SLUG)],
    status: Annotated[list[OperationStatus] | None, Query()] = None,
) -> dict[str, list[OperationView]]:
    statuses = [s.value for s in status or []]
    items = await read(kit, lambda session: service.controller_operations(session, principal, app_slug, statuses))
    return {"items": items}


@router.post(
    "/controller/operations/claim",
    response_model=Claim,
    tags=["controller"],
    responses={204: {"description": "nothing to claim"}},
)
async def controller_claim(body: ClaimRequest, principal: CurrentPrincipal, kit: Kit) -> ClaimView | Response:
    claimed = await change(
        kit,
        lambda session: service.claim(
            session,
            principal,
            app_slug=body.app_slug,
            operation_id=body.operation_id,
            lease_s=_lease_s(kit, body.lease_s),
            holder=body.holder,
        ),
    )
    return Response(status_code=204) if claimed is None else claimed


@router.post("/controller/operations/{operation_id}/heartbeat", response_model=Operation, tags=["controller"])
async def controller_heartbeat(
    operation_id: uuid.UUID, body: Heartbeat, principal: CurrentPrincipal, kit: Kit
) -> OperationView:
    return await change(
        kit,
        lambda session: service.heartbeat(
            session,
            principal,
            operation_id,
            body.lease_token,
            lease_s=_lease_s(kit, body.lease_s) if body.lease_s else None,  # None: the claim's length
            default_lease_s=kit.settings_as(Settings).lease_default_s,
            message=body.message,
            percent=body.percent,
        ),
    )


@router.post("/controller/operations/{operation_id}/complete", response_model=Operation, tags=["controller"])
async def controller_complete(
    operation_id: uuid.UUID, body: Completion, principal: CurrentPrincipal, kit: Kit
) -> OperationView:
    return await change(
        kit,
        lambda session: service.complete(
            session, principal, operation_id, body.lease_token, body.result, body.member_detail
        ),
    )


@router.post("/controller/operations/{operation_id}/fail", response_model=Operation, tags=["controller"])
async def controller_fail(
    operation_id: uuid.UUID, body: Failure, principal: CurrentPrincipal, kit: Kit
) -> OperationView:
    return await change(
        kit, lambda session: service.controller_fail(session, principal, operation_id, body.lease_token, body.error)
    )


@router.post("/controller/operations/{operation_id}/defer", response_model=Operation, tags=["controller"])
async def controller_defer(
    operation_id: uuid.UUID, body: Deferral, principal: CurrentPrincipal, kit: Kit
) -> OperationView:
    """Give the operation back without it counting as an attempt: it is offered again after `delay_s`
    (capped by the service), or as soon as its instance changes."""
    cap = kit.settings_as(Settings).defer_max_s
    delay = min(cap if body.delay_s is None else body.delay_s, cap)
    return await change(
        kit,
        lambda session: service.defer(
            session, principal, operation_id, body.lease_token, reason=body.reason, delay_s=delay
        ),
    )


# The users' route itself (the use case tells the instance's controller from a user), under its own name.
router.add_api_route(
    "/controller/instances/{instance_id}/operations",
    request_operation,
    methods=["POST"],
    name="controller_request_operation",
    description="As `POST /instances/{instance_id}/operations`, for the instance's controller (If-Match optional).",
    response_model=Operation,
    status_code=201,
    tags=["controller"],
    responses=PRECONDITION,
)


@router.put("/controller/instances/{instance_id}/status", response_model=Instance, tags=["controller"])
async def controller_report_instance(
    instance_id: uuid.UUID, body: InstanceReport, principal: CurrentPrincipal, kit: Kit
) -> InstanceView:
    health = body.health.model_dump(mode="json", exclude={"checked_at"}) if body.health else None
    return await change(
        kit,
        lambda session: service.report_instance(
            session,
            principal,
            instance_id,
            status=body.status,
            health=health,
            runtime_detail=body.runtime_detail,
            app_version=body.app_version,
        ),
    )


@router.put("/controller/members/{member_id}/status", response_model=Member, tags=["controller"])
async def controller_report_member(
    member_id: uuid.UUID, body: MemberReport, principal: CurrentPrincipal, kit: Kit
) -> MemberView:
    return await change(
        kit,
        lambda session: service.report_member(session, principal, member_id, status=body.status, detail=body.detail),
    )


@router.post(
    "/controller/instances/{instance_id}/events", response_model=TimelineEntry, status_code=201, tags=["controller"]
)
async def controller_event(
    instance_id: uuid.UUID, body: ControllerEvent, principal: CurrentPrincipal, kit: Kit
) -> TimelineEntryView:
    """Add an adapter event (e.g. `slurm.partition_ready`) to the instance timeline."""
    return await change(
        kit,
        lambda session: service.controller_event(
            session, principal, instance_id, kind=body.kind, message=body.message, data=body.data
        ),
    )


@router.get("/controller/instances/{instance_id}/credential", response_model=CredentialSecret, tags=["controller"])
async def controller_credential(
    instance_id: uuid.UUID, principal: CurrentPrincipal, kit: Kit, response: Response
) -> ControllerCredential:
    """The instance's SSH private key, for its controller only (audited; never cached)."""
    found = await change(kit, lambda session: service.credential_for_controller(session, principal, instance_id))
    credential = await service.open_credential(kit.state_as(AppRuntimeState).custody, found)  # outside it
    response.headers["Cache-Control"] = "no-store"
    return credential
