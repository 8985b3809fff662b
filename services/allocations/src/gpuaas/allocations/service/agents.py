"""The node agent's session with its host: node-token auth, (re)registration, heartbeats and
hosts whose agent went silent (their allocations are flagged for attention)."""

from __future__ import annotations

import uuid
from datetime import UTC, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import SERVICE
from gpuaas.allocations.metrics import heartbeat_lost
from gpuaas.allocations.models import agent_tasks, allocations, hosts
from gpuaas.allocations.service.common import (
    SYSTEM,
    alloc_state,
    now,
    poke_admission,
    record_timeline,
    update_allocation,
)
from gpuaas.allocations.service.hosts import hash_token, host_key_pin, host_state, update_host
from gpuaas.contracts.agent import AgentRegistration
from gpuaas.contracts.enums import AllocationStatus
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.contracts.events.allocations import HostState, HostStatus
from gpuaas.kit import audit
from gpuaas.kit.errors import Conflict, Unauthorized
from gpuaas.kit.logging import get_logger
from gpuaas.kit.outbox import add_event

log = get_logger(__name__)


async def host_by_token(session: AsyncSession, token: str | None, *, lock: bool = False) -> Any:
    if not token or not token.startswith("gpn_"):
        raise Unauthorized("a node token is required", code="invalid_node_token")
    q = select(hosts).where(hosts.c.node_token_hash == hash_token(token))
    row = (await session.execute(q.with_for_update() if lock else q)).first()
    if row is None or row.status == HostStatus.decommissioned:
        raise Unauthorized("unknown or revoked node token", code="invalid_node_token")
    return row


async def agent_host_id(session: AsyncSession, token: str | None) -> uuid.UUID:
    """The host whose agent presents this node token (401 if none)."""
    host_id: uuid.UUID = (await host_by_token(session, token)).host_id
    return host_id


async def register_agent(session: AsyncSession, token: str | None, body: AgentRegistration) -> HostState:
    """The agent (re)starts: inventory, driver, endpoint; the host becomes `ready` (or returns from
    `unreachable`). Tasks it had leased are handed out again at once: a restarted agent replays
    its journal for the ones it had finished, so nothing is lost and nothing runs twice.

    The SSH endpoint and host key are pinned by the enrolment or the first registration that reports
    them; a later registration reporting others is refused (409 `host_key_mismatch` /
    `host_endpoint_mismatch`): the node token alone must not let anyone redirect users' SSH and the
    browser terminal. An operator re-enrolment resets the pins."""
    host = await host_by_token(session, token, lock=True)
    pins = _check_pins(host, ssh_host=body.ssh_host, ssh_port=body.ssh_port, ssh_host_key=body.ssh_host_key)
    status = host.status
    if status == HostStatus.enrolling:
        status = HostStatus.ready
    elif status == HostStatus.unreachable:
        status = host.status_before_unreachable or HostStatus.ready
    if status == HostStatus.ready:  # a host (back) in service: waiting requests may fit on it
        await poke_admission(session)
    row = await update_host(
        session,
        host.host_id,
        status=status,
        agent_version=body.agent_version,
        inventory_source=body.inventory_source,
        gpus=[g.model_dump(mode="json") for g in body.gpus],
        last_heartbeat_at=now(),
        status_before_unreachable=None,
        driver=body.driver,
        isolates_tenants=body.isolates_tenants,
        cpu_count=body.cpu_count,
        memory_mb=body.memory_mb,
        **pins,
    )
    await session.execute(
        update(agent_tasks)
        .where(agent_tasks.c.host_id == host.host_id, agent_tasks.c.status == "leased")
        .values(status="pending", lease_token=None, lease_expires_at=None)
    )
    state = host_state(row)
    await add_event(session, allocation_events.HostUpdated.build(data=state, source=SERVICE, actor=SYSTEM))
    await audit.record(
        session,
        service=SERVICE,
        actor=SYSTEM,
        action="allocations.host.register",
        resource_type="host",
        resource_id=host.host_id,
        before={"status": host.status},
        after={
            "status": status,
            "gpus": len(body.gpus),
            "agent_version": body.agent_version,
            "driver": body.driver,
            "isolates_tenants": body.isolates_tenants,
            **({"pinned": sorted(pins)} if pins else {}),
        },
    )
    if host.status == HostStatus.unreachable:
        await _set_attention_for_host(session, host.host_id, None)
    return state


def _check_pins(host: Any, *, ssh_host: str, ssh_port: int, ssh_host_key: str | None) -> dict[str, Any]:
    """The pin columns a registration sets (those not pinned yet); 409 when it contradicts a pin."""
    pins: dict[str, Any] = {}
    key = host_key_pin(ssh_host_key)
    if key:
        if host.ssh_host_key is None:
            pins.update(key)
        elif key["ssh_host_key"].split()[:2] != host.ssh_host_key.split()[:2]:
            log.warning(
                "agent_host_key_mismatch",
                host_id=str(host.host_id),
                pinned=host.ssh_host_key_fingerprint,
                reported=key["ssh_host_key_fingerprint"],
            )
            raise Conflict(
                f"the SSH host key {key['ssh_host_key_fingerprint']} is not the one pinned for this host "
                f"({host.ssh_host_key_fingerprint}); an operator re-enrolment resets the pin",
                code="host_key_mismatch",
            )
    if host.ssh_host is None:
        pins.update(ssh_host=ssh_host, ssh_port=ssh_port)
    elif (host.ssh_host, host.ssh_port) != (ssh_host, ssh_port):
        log.warning("agent_endpoint_mismatch", host_id=str(host.host_id), reported=f"{ssh_host}:{ssh_port}")
        raise Conflict(
            f"the SSH endpoint {ssh_host}:{ssh_port} is not the one pinned for this host "
            f"({host.ssh_host}:{host.ssh_port}); an operator re-enrolment resets the pin",
            code="host_endpoint_mismatch",
        )
    return pins


async def heartbeat(session: AsyncSession, token: str | None) -> HostState:
    host = await host_by_token(session, token, lock=True)
    if host.status == HostStatus.unreachable:
        row = await update_host(
            session,
            host.host_id,
            status=host.status_before_unreachable or HostStatus.ready,
            status_before_unreachable=None,
            last_heartbeat_at=now(),
        )
        await poke_admission(session)
        await add_event(
            session, allocation_events.HostUpdated.build(data=host_state(row), source=SERVICE, actor=SYSTEM)
        )
        await audit.record(
            session,
            service=SERVICE,
            actor=SYSTEM,
            action="allocations.host.recovered",
            resource_type="host",
            resource_id=host.host_id,
            before={"status": host.status},
            after={"status": row.status},
        )
        await _set_attention_for_host(session, host.host_id, None)
        return host_state(row)
    await session.execute(update(hosts).where(hosts.c.host_id == host.host_id).values(last_heartbeat_at=now()))
    return host_state(host)


async def mark_lost_hosts(session: AsyncSession, *, timeout_s: float) -> list[uuid.UUID]:
    """Hosts whose agent stopped heartbeating become `unreachable`; their allocations say so."""
    cutoff = now() - timedelta(seconds=timeout_s)
    rows = (
        await session.execute(
            select(hosts)
            .where(
                hosts.c.status.in_([HostStatus.ready, HostStatus.cordoned]),
                hosts.c.last_heartbeat_at < cutoff,
            )
            .with_for_update(skip_locked=True)
        )
    ).all()
    lost = []
    for host in rows:
        row = await update_host(
            session, host.host_id, status=HostStatus.unreachable, status_before_unreachable=host.status
        )
        await add_event(
            session, allocation_events.HostHeartbeatLost.build(data=host_state(row), source=SERVICE, actor=SYSTEM)
        )
        await audit.record(
            session,
            service=SERVICE,
            actor=SYSTEM,
            action="allocations.host.heartbeat_lost",
            resource_type="host",
            resource_id=host.host_id,
            before={"status": host.status},
            after={"status": row.status},
            reason=f"no heartbeat since {host.last_heartbeat_at}",
        )
        since = host.last_heartbeat_at.astimezone(UTC).isoformat(timespec="seconds")
        await _set_attention_for_host(
            session, host.host_id, f"host {host.name} is unreachable: its agent has not reported since {since}"
        )
        lost.append(host.host_id)
    heartbeat_lost(session, len(lost))
    return lost


async def _set_attention_for_host(session: AsyncSession, host_id: uuid.UUID, attention: str | None) -> None:
    rows = await session.execute(
        select(allocations.c.allocation_id)
        .where(
            allocations.c.host_id == host_id,
            allocations.c.status.notin_([AllocationStatus.released, AllocationStatus.failed]),
        )
        .with_for_update()
    )
    for (alloc_id,) in rows:
        row = await update_allocation(session, alloc_id, attention=attention)
        await add_event(
            session,
            allocation_events.AllocationAttentionChanged.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM),
        )
        await record_timeline(
            session,
            alloc_id,
            "host",
            "failed" if attention else "succeeded",
            attention or "the host's agent reports again",
        )
