"""Hosts as operators see them: enrol (optionally with the SSH endpoint and host key to pin), re-enrol
(new token, pins reset), rotate the node token, list, cordon, drain, uncordon, the tenancy override."""

from __future__ import annotations

import hashlib
import secrets
import uuid
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import SERVICE, domain
from gpuaas.allocations.models import allocations, hosts
from gpuaas.allocations.service.common import poke_admission
from gpuaas.allocations.service.lifecycle import request_release
from gpuaas.contracts import Actor, new_event_id
from gpuaas.contracts.enums import AllocationStatus
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.contracts.events.allocations import GpuDevice, HostEnrolled, HostState, HostStatus
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound, Unprocessable
from gpuaas.kit.outbox import add_event


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def host_state(row: Any) -> HostState:
    return HostState(
        host_id=row.host_id,
        name=row.name,
        status=row.status,
        host_class=row.host_class,
        labels=row.labels,
        gpus=[GpuDevice.model_validate(g) for g in row.gpus],
        inventory_source=row.inventory_source,
        agent_version=row.agent_version,
        last_heartbeat_at=row.last_heartbeat_at,
        cordon_reason=row.cordon_reason,
        version=row.version,
        driver=row.driver,
        isolates_tenants=row.isolates_tenants,
        shared_tenancy_allowed=row.shared_tenancy_allowed,
        cpu_count=row.cpu_count,
        memory_mb=row.memory_mb,
        ssh_host_key_fingerprint=row.ssh_host_key_fingerprint,
    )


def host_key_pin(ssh_host_key: str | None) -> dict[str, Any]:
    """The columns that pin an SSH host key (an OpenSSH public key line), validated."""
    if not ssh_host_key:
        return {}
    try:
        line, fingerprint = domain.parse_public_key(ssh_host_key)
    except Unprocessable as exc:
        raise Unprocessable(f"ssh_host_key: {exc.detail}", code="invalid_host_key") from None
    return {"ssh_host_key": line, "ssh_host_key_fingerprint": fingerprint}


async def enrol_host(
    session: AsyncSession,
    principal: Principal,
    *,
    name: str,
    host_class: str | None,
    labels: dict[str, str],
    gpus: list[GpuDevice],
    pins: dict[str, Any] | None = None,
) -> tuple[HostState, str]:
    """An operator enrols a host: it gets an id and a one-time node token for its agent. `pins` (ssh_host,
    ssh_port, ssh_host_key) fix the SSH endpoint and host key now; else the first registration pins them."""
    await iam.authorize(session, principal, "allocations.host.manage")
    return await enrol_host_unchecked(
        session, principal.actor, name=name, host_class=host_class, labels=labels, gpus=gpus, pins=pins
    )


async def enrol_host_unchecked(
    session: AsyncSession,
    actor: Actor,
    *,
    name: str,
    host_class: str | None,
    labels: dict[str, str],
    gpus: list[GpuDevice],
    pins: dict[str, Any] | None = None,
) -> tuple[HostState, str]:
    pins = pins or {}
    if (await session.execute(select(hosts.c.host_id).where(hosts.c.name == name))).first():
        raise Conflict(f"a host named {name!r} is already enrolled", code="host_name_taken")
    host_id = new_event_id()
    token = "gpn_" + secrets.token_urlsafe(32)
    await session.execute(
        insert(hosts).values(
            host_id=host_id,
            name=name,
            status=HostStatus.enrolling,
            host_class=host_class,
            labels=labels,
            gpus=[g.model_dump(mode="json") for g in gpus],
            node_token_hash=hash_token(token),
            ssh_host=pins.get("ssh_host"),
            ssh_port=pins.get("ssh_port"),
            **host_key_pin(pins.get("ssh_host_key")),
        )
    )
    row = (await session.execute(select(hosts).where(hosts.c.host_id == host_id))).one()
    state = host_state(row)
    await add_event(session, HostEnrolled.build(subject=host_id, data=state, source=SERVICE, actor=actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=actor,
        action="allocations.host.enroll",
        resource_type="host",
        resource_id=host_id,
        after=state.model_dump(mode="json"),
    )
    return state, token


async def rotate_node_token(session: AsyncSession, principal: Principal, host_id: uuid.UUID) -> tuple[HostState, str]:
    """A new node token for a host (the old one stops working at once), e.g. when an agent's copy is lost."""
    await iam.authorize(session, principal, "allocations.host.manage")
    await load_host(session, host_id, lock=True)
    token = "gpn_" + secrets.token_urlsafe(32)
    row = await update_host(session, host_id, node_token_hash=hash_token(token))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.host.rotate_token",
        resource_type="host",
        resource_id=host_id,
    )
    return host_state(row), token


_PINNED = ("ssh_host", "ssh_port", "ssh_host_key_fingerprint")


async def reenrol_host(
    session: AsyncSession, principal: Principal, host_id: uuid.UUID, *, reason: str, pins: dict[str, Any]
) -> tuple[HostState, str]:
    """Re-enrolment (e.g. the machine was reinstalled): a new node token, and the pinned SSH endpoint and
    host key are reset (to `pins` if given, else the next registration pins them). Audited."""
    await iam.authorize(session, principal, "allocations.host.manage")
    before = await load_host(session, host_id, lock=True)
    if before.status == HostStatus.decommissioned:
        raise Conflict("the host is decommissioned", code="host_decommissioned")
    token = "gpn_" + secrets.token_urlsafe(32)
    key_pin = host_key_pin(pins.get("ssh_host_key")) or {"ssh_host_key": None, "ssh_host_key_fingerprint": None}
    row = await update_host(
        session,
        host_id,
        node_token_hash=hash_token(token),
        ssh_host=pins.get("ssh_host"),
        ssh_port=pins.get("ssh_port"),
        **key_pin,
    )
    state = await _announce(
        session,
        principal,
        row,
        allocation_events.HostUpdated,
        action="allocations.host.reenrol",
        before={k: getattr(before, k) for k in _PINNED},
        after={k: getattr(row, k) for k in _PINNED},
        reason=reason,
    )
    return state, token


async def set_tenancy(
    session: AsyncSession, principal: Principal, host_id: uuid.UUID, *, shared_tenancy_allowed: bool, reason: str
) -> HostState:
    """The operator override: let several tenants share a host whose driver does not isolate them (or
    stop it; allocations already there stay). Audited with the reason."""
    await iam.authorize(session, principal, "allocations.host.manage")
    before = await load_host(session, host_id, lock=True)
    row = await update_host(session, host_id, shared_tenancy_allowed=shared_tenancy_allowed)
    return await _announce(
        session,
        principal,
        row,
        allocation_events.HostUpdated,
        action="allocations.host.tenancy",
        before={"shared_tenancy_allowed": before.shared_tenancy_allowed, "isolates_tenants": before.isolates_tenants},
        after={"shared_tenancy_allowed": shared_tenancy_allowed, "isolates_tenants": row.isolates_tenants},
        reason=reason,
    )


async def list_hosts(session: AsyncSession) -> list[HostState]:
    rows = await session.execute(select(hosts).order_by(hosts.c.created_at))
    return [host_state(r) for r in rows]


async def get_host(session: AsyncSession, host_id: uuid.UUID) -> HostState:
    return host_state(await load_host(session, host_id))


async def load_host(session: AsyncSession, host_id: uuid.UUID, *, lock: bool = False) -> Any:
    q = select(hosts).where(hosts.c.host_id == host_id)
    row = (await session.execute(q.with_for_update() if lock else q)).first()
    if row is None:
        raise NotFound("host not found", code="host_not_found")
    return row


async def update_host(session: AsyncSession, host_id: uuid.UUID, **values: Any) -> Any:
    return (
        await session.execute(
            update(hosts)
            .where(hosts.c.host_id == host_id)
            .values(version=hosts.c.version + 1, **values)
            .returning(*hosts.c)
        )
    ).one()


async def _announce(
    session: AsyncSession,
    principal: Principal,
    row: Any,
    event: type[allocation_events.HostUpdated] | type[allocation_events.HostCordoned],
    *,
    action: str,
    before: dict[str, Any],
    after: dict[str, Any],
    reason: str | None = None,
) -> HostState:
    """An operator's change to a host row: its event and its audit record, in the caller's transaction."""
    state = host_state(row)
    await add_event(session, event.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action=action,
        resource_type="host",
        resource_id=row.host_id,
        before=before,
        after=after,
        reason=reason,
    )
    return state


async def cordon_host(
    session: AsyncSession, principal: Principal, host_id: uuid.UUID, *, reason: str, drain: bool
) -> HostState:
    """Cordon: no new allocations. Drain: cordon and request the release of every allocation on it."""
    await iam.authorize(session, principal, "allocations.host.manage")
    before = await load_host(session, host_id, lock=True)
    if before.status == HostStatus.decommissioned:
        raise Conflict("the host is decommissioned", code="host_decommissioned")
    values: dict[str, Any] = {"cordon_reason": reason}
    if before.status == HostStatus.unreachable:
        values["status_before_unreachable"] = HostStatus.cordoned
    else:
        values["status"] = HostStatus.cordoned
    row = await update_host(session, host_id, **values)
    state = await _announce(
        session,
        principal,
        row,
        allocation_events.HostCordoned,
        action="allocations.host.drain" if drain else "allocations.host.cordon",
        before={"status": before.status},
        after={"status": row.status},
        reason=reason,
    )
    if drain:
        live = await session.execute(
            select(allocations.c.allocation_id).where(
                allocations.c.host_id == host_id,
                allocations.c.status.in_(
                    [AllocationStatus.active, AllocationStatus.restarting, AllocationStatus.resizing]
                ),
            )
        )
        for (alloc_id,) in live:
            await request_release(session, principal.actor, alloc_id, reason=f"host drained: {reason}")
    return state


async def uncordon_host(session: AsyncSession, principal: Principal, host_id: uuid.UUID) -> HostState:
    await iam.authorize(session, principal, "allocations.host.manage")
    before = await load_host(session, host_id, lock=True)
    if before.status == HostStatus.unreachable:
        row = await update_host(session, host_id, cordon_reason=None, status_before_unreachable=HostStatus.ready)
    elif before.status == HostStatus.cordoned:
        row = await update_host(session, host_id, cordon_reason=None, status=HostStatus.ready)
    else:
        raise Conflict(f"the host is {before.status}, not cordoned", code="host_not_cordoned")
    await poke_admission(session)  # its free GPUs can take waiting requests
    return await _announce(
        session,
        principal,
        row,
        allocation_events.HostUpdated,
        action="allocations.host.uncordon",
        before={"status": before.status},
        after={"status": row.status},
    )
