"""The node agents' routes: they dial out with their node token (never a user JWT).

    POST /agent/register        inventory, driver, SSH endpoint and host key (pinned at the first
                                registration; 409 on a mismatch); returns the platform SSH CA key
    POST /agent/heartbeat
    GET  /agent/tasks?wait_s=   long-poll: leases the host's next tasks (in queue order)
    POST /agent/tasks/{id}/progress   a step of the task (timeline entry); extends the lease
    POST /agent/tasks/{id}/complete   the outcome, applied once (repeats are no-ops)

Task wake-ups: the use case that queues a task sends `pg_notify('allocations_tasks', host_id)` in
its transaction; every replica LISTENs (`reconciler.listen_for_tasks`), so a long-poll on any replica returns
right after commit.
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import suppress

from fastapi import APIRouter, Query, Request

from gpuaas.allocations import service
from gpuaas.allocations.runtime import AllocationsRuntime
from gpuaas.allocations.service.overlay import segments_of_host
from gpuaas.allocations.settings import Settings
from gpuaas.contracts.agent import (
    AgentRegistered,
    AgentRegistration,
    CompletionAck,
    HeartbeatAck,
    TaskCompletion,
    TaskLease,
    TaskProgress,
)
from gpuaas.kit.app import Kit

router = APIRouter(prefix="/agent", tags=["agent"])


def _token(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


@router.post("/register", response_model=AgentRegistered)
async def register(kit: Kit, request: Request, body: AgentRegistration) -> AgentRegistered:
    runtime = kit.state_as(AllocationsRuntime)
    async with kit.sessions() as session, session.begin():
        state = await service.register_agent(
            session,
            _token(request),
            body,
        )
    runtime.wakeups.notify(state.host_id)
    return AgentRegistered(
        host_id=state.host_id,
        name=state.name,
        status=state.status,
        heartbeat_interval_s=kit.settings_as(Settings).agent_heartbeat_interval_s,
        ssh_ca_public_key=runtime.terminal_ca.public,
    )


@router.post("/heartbeat", response_model=HeartbeatAck)
async def heartbeat(kit: Kit, request: Request) -> HeartbeatAck:
    async with kit.sessions() as session, session.begin():
        host = await service.heartbeat(session, _token(request))
        overlays = await segments_of_host(session, host.host_id)  # peers and names follow members (issue 27)
    return HeartbeatAck(host_id=host.host_id, status=host.status, overlays=overlays)


@router.get("/tasks", response_model=list[TaskLease])
async def poll_tasks(kit: Kit, request: Request, wait_s: float = Query(20.0, ge=0, le=60)) -> list[TaskLease]:
    settings = kit.settings_as(Settings)
    async with kit.sessions() as session:
        host_id = await service.agent_host_id(session, _token(request))
    wake = kit.state_as(AllocationsRuntime).wakeups.event(host_id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(wait_s, settings.agent_long_poll_max_s)
    while True:
        wake.clear()
        if await request.is_disconnected():  # never lease tasks to a poll nobody reads any more
            return []
        async with kit.sessions() as session, session.begin():
            tasks = await service.claim_tasks(session, host_id, lease_s=settings.agent_task_lease_s)
        if tasks:
            return tasks
        remaining = deadline - loop.time()
        if remaining <= 0:
            return []
        with suppress(TimeoutError):  # woken by a task for this host, else poll again within a second
            async with asyncio.timeout(min(remaining, 1.0)):  # not wait_for: it can swallow a cancel on 3.11
                await wake.wait()


@router.post("/tasks/{task_id}/progress", status_code=204)
async def progress(kit: Kit, request: Request, task_id: uuid.UUID, body: TaskProgress) -> None:
    async with kit.sessions() as session, session.begin():
        await service.report_progress(
            session, _token(request), task_id, body, lease_s=kit.settings_as(Settings).agent_task_lease_s
        )


@router.post("/tasks/{task_id}/complete", response_model=CompletionAck)
async def complete(kit: Kit, request: Request, task_id: uuid.UUID, body: TaskCompletion) -> CompletionAck:
    async with kit.sessions() as session, session.begin():
        applied = await service.complete_task(session, _token(request), task_id, body)
    return CompletionAck(applied=applied)
