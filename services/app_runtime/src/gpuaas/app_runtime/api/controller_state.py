"""A controller's own state per instance (`/controller/instances/{id}/state`): read it, and write it naming
the version read (compare-and-set; 409 `state_version_conflict` when another replica wrote first)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter

from gpuaas.app_runtime.api.calls import change, read
from gpuaas.app_runtime.api.schemas import ControllerState, ControllerStateWrite
from gpuaas.app_runtime.service.controller_state import ControllerStateView, controller_state, put_controller_state
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal

router = APIRouter()


@router.get("/controller/instances/{instance_id}/state", response_model=ControllerState, tags=["controller"])
async def get_controller_state(instance_id: uuid.UUID, principal: CurrentPrincipal, kit: Kit) -> ControllerStateView:
    return await read(kit, lambda session: controller_state(session, principal, instance_id))


@router.put(
    "/controller/instances/{instance_id}/state",
    response_model=ControllerState,
    tags=["controller"],
    responses={409: {"description": "`state_version_conflict`: another write came first; re-read and retry"}},
)
async def put_state(
    instance_id: uuid.UUID, body: ControllerStateWrite, principal: CurrentPrincipal, kit: Kit
) -> ControllerStateView:
    return await change(
        kit,
        lambda session: put_controller_state(
            session, principal, instance_id, body.state, expected_version=body.expected_version
        ),
    )
