"""The gateway's questions about a launchable instance's browser workload (issue 21), asked with the
user's own token: where `/apps/{instance_id}/` may be forwarded for this caller (`GET`), the same with an
audit record when a browser session opens it (`POST .../open`), and a stream that ends when the caller loses
access (`.../watch`: the gateway closes the proxied WebSockets then; the rule of the other streams,
`gpuaas.kit.revocation`). Answers name the enrolled host's address, never a user-supplied one."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from sse_starlette.sse import EventSourceResponse

from gpuaas.app_runtime.service import launch
from gpuaas.kit import iam, revocation
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal, current_principal

router = APIRouter()
OPEN_DOC = iam.action_doc(launch.OPEN_ACTION)


@router.get("/instances/{instance_id}/workload", tags=["launchable apps"], openapi_extra=OPEN_DOC)
async def workload_upstream(instance_id: uuid.UUID, principal: CurrentPrincipal, kit: Kit) -> dict[str, Any]:
    """Where the gateway forwards `/apps/{instance_id}/` for the caller (404/403/409 `workload_not_ready`)."""
    async with kit.sessions() as session:
        return await launch.workload_upstream(session, principal, instance_id, audit=False)


@router.post("/instances/{instance_id}/workload/open", tags=["launchable apps"], openapi_extra=OPEN_DOC)
async def open_workload(instance_id: uuid.UUID, principal: CurrentPrincipal, kit: Kit) -> dict[str, Any]:
    """As GET, recording that the caller opened the app (audit + timeline)."""
    async with kit.sessions() as session, session.begin():
        return await launch.workload_upstream(session, principal, instance_id, audit=True)


@router.get("/instances/{instance_id}/workload/watch", tags=["launchable apps"], openapi_extra=OPEN_DOC)
async def watch_workload(instance_id: uuid.UUID, request: Request, kit: Kit) -> EventSourceResponse:
    """`event: open` (the upstream), then pings until the caller may no longer open the app: a last
    `event: access_revoked` (problem JSON) and the end."""
    principal = await current_principal(request)
    async with kit.sessions() as session:
        upstream = await launch.workload_upstream(session, principal, instance_id, audit=False)

    async def recheck() -> None:
        async with kit.sessions() as session:
            await launch.workload_upstream(session, principal, instance_id, audit=False)

    async def events() -> AsyncIterator[dict[str, str]]:
        yield {"event": "open", "data": json.dumps(upstream)}
        while not await request.is_disconnected():
            await asyncio.sleep(3600)
            yield {"event": "ping", "data": "{}"}

    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    if kit.revocations is None:
        return EventSourceResponse(events(), ping=10, headers=headers)
    lost = revocation.until_access_lost(kit.revocations, principal, recheck, keys=[uuid.UUID(upstream["project_id"])])
    return EventSourceResponse(revocation.guarded(events(), lost, revocation.sse_refusal), ping=10, headers=headers)
