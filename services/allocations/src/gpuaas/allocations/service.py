"""Allocations use cases (one transaction each: state + outbox + audit)."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations.models import hosts
from gpuaas.contracts import new_event_id
from gpuaas.contracts.events.allocations import GpuDevice, HostEnrolled, HostState, HostStatus
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict
from gpuaas.kit.outbox import add_event

SERVICE = "allocations"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


async def enrol_host(
    session: AsyncSession,
    principal: Principal,
    *,
    name: str,
    host_class: str | None,
    labels: dict[str, str],
    gpus: list[GpuDevice],
) -> tuple[HostState, str]:
    """An operator enrols a host: it gets an id and a one-time node token for its agent."""
    await iam.authorize(session, principal, "allocations.host.manage")
    if (await session.execute(select(hosts.c.host_id).where(hosts.c.name == name))).first():
        raise Conflict(f"a host named {name!r} is already enrolled", code="host_name_taken")
    host_id = new_event_id()
    token = "gpn_" + secrets.token_urlsafe(32)
    state = HostState(
        host_id=host_id,
        name=name,
        status=HostStatus.enrolling,
        host_class=host_class,
        labels=labels,
        gpus=gpus,
        version=1,
    )
    await session.execute(
        insert(hosts).values(
            host_id=host_id,
            name=name,
            status=state.status,
            host_class=host_class,
            labels=labels,
            gpus=[g.model_dump(mode="json") for g in gpus],
            node_token_hash=hash_token(token),
        )
    )
    await add_event(session, HostEnrolled.build(subject=host_id, data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.host.enroll",
        resource_type="host",
        resource_id=host_id,
        after=state.model_dump(mode="json"),
    )
    return state, token


async def list_hosts(session: AsyncSession) -> list[dict[str, Any]]:
    rows = await session.execute(select(hosts).order_by(hosts.c.created_at))
    return [dict(r._mapping) for r in rows]
