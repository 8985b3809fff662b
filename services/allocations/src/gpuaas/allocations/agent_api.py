"""The node agents' surface: they dial out with their node token (never a user JWT).

    POST /agent/register        inventory + SSH endpoint; returns the platform SSH CA key
    POST /agent/heartbeat
    GET  /agent/tasks?wait_s=   long-poll: leases the host's next tasks (in queue order)
    POST /agent/tasks/{id}/progress   a step of the task (timeline entry); extends the lease
    POST /agent/tasks/{id}/complete   the outcome, applied once (repeats are no-ops)

Task wake-ups: the use case that queues a task sends `pg_notify('allocations_tasks', host_id)` in
its transaction; every replica LISTENs, so a long-poll on any replica returns right after commit.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime
from typing import Any, Literal

import asyncpg
from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from gpuaas.allocations import service
from gpuaas.contracts.events.allocations import GpuDevice
from gpuaas.kit.db import to_plain_url
from gpuaas.kit.logging import get_logger

router = APIRouter(prefix="/agent", tags=["agent"])
log = get_logger(__name__)


class Wakeups:
    """Per-host events set when a task is queued for that host."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def event(self, host_id: uuid.UUID | str) -> asyncio.Event:
        return self._events.setdefault(str(host_id), asyncio.Event())

    def notify(self, host_id: uuid.UUID | str | None) -> None:
        if host_id is not None:
            self.event(host_id).set()


async def listen_for_tasks(kit: Any) -> None:
    """Background loop: LISTEN allocations_tasks and wake the long-polls of that host."""
    wakeups: Wakeups = kit.extras["wakeups"]
    dsn = to_plain_url(kit.settings.database_url.get_secret_value())
    while True:
        conn = None
        try:
            conn = await asyncpg.connect(dsn)
            await conn.add_listener("allocations_tasks", lambda _c, _p, _ch, payload: wakeups.notify(payload))
            while not conn.is_closed():
                await asyncio.sleep(5)
                await conn.execute("SELECT 1")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the long-poll falls back to polling meanwhile
            log.warning("task_listener_down", error=str(exc))
            await asyncio.sleep(2)
        finally:
            if conn is not None and not conn.is_closed():
                await conn.close()


def _token(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


class Register(BaseModel):
    agent_version: str = Field(max_length=64)
    gpus: list[GpuDevice] = Field(default_factory=list, max_length=64)
    inventory_source: Literal["nvidia-smi", "declared"] = "declared"
    ssh_host: str = Field(max_length=255)
    ssh_port: int = Field(ge=1, le=65535)


class Registered(BaseModel):
    host_id: uuid.UUID
    name: str
    status: str
    heartbeat_interval_s: float
    ssh_ca_public_key: str = Field(description="trust certificates signed by this key (browser terminal sessions)")


class Task(BaseModel):
    task_id: uuid.UUID
    kind: str
    allocation_id: uuid.UUID | None
    payload: dict[str, Any]
    attempts: int
    lease_expires_at: datetime | None


class Progress(BaseModel):
    phase: str = Field(max_length=100)
    status: Literal["started", "succeeded", "failed", "info"] = "info"
    message: str = Field("", max_length=2000)
    started_at: datetime | None = None
    finished_at: datetime | None = None


class Completion(BaseModel):
    ok: bool
    message: str = Field("", max_length=4000)
    result: dict[str, Any] = Field(default_factory=dict)


@router.post("/register", response_model=Registered)
async def register(request: Request, body: Register) -> Any:
    kit = request.app.state.kit
    async with kit.sessions() as session, session.begin():
        state = await service.register_agent(
            session,
            _token(request),
            agent_version=body.agent_version,
            gpus=body.gpus,
            inventory_source=body.inventory_source,
            ssh_host=body.ssh_host,
            ssh_port=body.ssh_port,
        )
    kit.extras["wakeups"].notify(state.host_id)
    return {
        "host_id": state.host_id,
        "name": state.name,
        "status": state.status,
        "heartbeat_interval_s": kit.settings.agent_heartbeat_interval_s,
        "ssh_ca_public_key": kit.extras["ssh_ca"].public,
    }


@router.post("/heartbeat")
async def heartbeat(request: Request) -> dict[str, Any]:
    async with request.app.state.kit.sessions() as session, session.begin():
        host = await service.heartbeat(session, _token(request))
    return {"host_id": str(host.host_id), "status": host.status}


@router.get("/tasks", response_model=list[Task])
async def poll_tasks(request: Request, wait_s: float = Query(20.0, ge=0, le=60)) -> Any:
    kit = request.app.state.kit
    s = kit.settings
    async with kit.sessions() as session:
        host = await service.host_by_token(session, _token(request))
    wake = kit.extras["wakeups"].event(host.host_id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(wait_s, s.agent_long_poll_max_s)
    while True:
        wake.clear()
        if await request.is_disconnected():  # never lease tasks to a poll nobody reads any more
            return []
        async with kit.sessions() as session, session.begin():
            tasks = await service.claim_tasks(session, host.host_id, lease_s=s.agent_task_lease_s)
        if tasks:
            return [dict(t._mapping) for t in tasks]
        remaining = deadline - loop.time()
        if remaining <= 0:
            return []
        try:
            await asyncio.wait_for(wake.wait(), min(remaining, 1.0))
        except TimeoutError:
            pass


@router.post("/tasks/{task_id}/progress", status_code=204)
async def progress(request: Request, task_id: uuid.UUID, body: Progress) -> None:
    kit = request.app.state.kit
    async with kit.sessions() as session, session.begin():
        host = await service.host_by_token(session, _token(request))
        await service.report_progress(
            session,
            host.host_id,
            task_id,
            phase=body.phase,
            status=body.status,
            message=body.message,
            started_at=body.started_at,
            finished_at=body.finished_at,
            lease_s=kit.settings.agent_task_lease_s,
        )


@router.post("/tasks/{task_id}/complete")
async def complete(request: Request, task_id: uuid.UUID, body: Completion) -> dict[str, Any]:
    kit = request.app.state.kit
    async with kit.sessions() as session, session.begin():
        host = await service.host_by_token(session, _token(request))
        applied = await service.complete_task(
            session, host.host_id, task_id, ok=body.ok, message=body.message, result=body.result
        )
    return {"applied": applied}
