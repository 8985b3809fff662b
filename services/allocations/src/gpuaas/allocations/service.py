"""Allocations use cases. Each runs in the caller's ONE transaction: state + outbox events + audit.

The caller (api.py, handlers.py, the reconciler) owns the transaction; nothing here commits or
talks to the network. Agent work is queued as rows of `agent_tasks` in the same transaction as the
state change that needs it, so a crash never leaves a state without its task or a task without
its state.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, func, insert, or_, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import domain
from gpuaas.allocations.models import (
    agent_tasks,
    allocations,
    app_members,
    gpu_assignments,
    hosts,
    quotas,
    ssh_grants,
    ssh_keys,
    timeline,
    volume_attachments,
    volumes,
)
from gpuaas.contracts import Actor, Event, new_event_id
from gpuaas.contracts.enums import AllocationStatus as S
from gpuaas.contracts.enums import CapacityShape, MembershipScope
from gpuaas.contracts.events import allocations as ev
from gpuaas.contracts.events.allocations import (
    AllocationState,
    GpuDevice,
    HostEnrolled,
    HostState,
    HostStatus,
    SshEndpoint,
    SshGrantState,
    VolumeAttachment,
    VolumeState,
)
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, Forbidden, NotFound, Unauthorized, Unprocessable
from gpuaas.kit.outbox import add_event, add_events
from gpuaas.kit.tables import iam_memberships

SERVICE = "allocations"
SYSTEM = Actor.system("allocations")
LIVE_MEMBER = ("pending", "starting", "active", "draining", "stopping")


def now() -> datetime:
    return datetime.now(UTC)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _actor(who: Principal | Actor) -> Actor:
    return who.actor if isinstance(who, Principal) else who


# ------------------------------------------------------------------------------------------------ hosts


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
    )


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
    return await enrol_host_unchecked(
        session, principal.actor, name=name, host_class=host_class, labels=labels, gpus=gpus
    )


async def enrol_host_unchecked(
    session: AsyncSession,
    actor: Actor,
    *,
    name: str,
    host_class: str | None,
    labels: dict[str, str],
    gpus: list[GpuDevice],
) -> tuple[HostState, str]:
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
    await get_host(session, host_id, lock=True)
    token = "gpn_" + secrets.token_urlsafe(32)
    row = await _update_host(session, host_id, node_token_hash=hash_token(token))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.host.rotate_token",
        resource_type="host",
        resource_id=host_id,
    )
    return host_state(row), token


async def list_hosts(session: AsyncSession) -> list[HostState]:
    rows = await session.execute(select(hosts).order_by(hosts.c.created_at))
    return [host_state(r) for r in rows]


async def get_host(session: AsyncSession, host_id: uuid.UUID, *, lock: bool = False) -> Any:
    q = select(hosts).where(hosts.c.host_id == host_id)
    row = (await session.execute(q.with_for_update() if lock else q)).first()
    if row is None:
        raise NotFound("host not found", code="host_not_found")
    return row


async def _update_host(session: AsyncSession, host_id: uuid.UUID, **values: Any) -> Any:
    return (
        await session.execute(
            update(hosts)
            .where(hosts.c.host_id == host_id)
            .values(version=hosts.c.version + 1, **values)
            .returning(*hosts.c)
        )
    ).one()


async def cordon_host(
    session: AsyncSession, principal: Principal, host_id: uuid.UUID, *, reason: str, drain: bool
) -> HostState:
    """Cordon: no new allocations. Drain: cordon and request the release of every allocation on it."""
    await iam.authorize(session, principal, "allocations.host.manage")
    before = await get_host(session, host_id, lock=True)
    if before.status == HostStatus.decommissioned:
        raise Conflict("the host is decommissioned", code="host_decommissioned")
    values: dict[str, Any] = {"cordon_reason": reason}
    if before.status == HostStatus.unreachable:
        values["status_before_unreachable"] = HostStatus.cordoned
    else:
        values["status"] = HostStatus.cordoned
    row = await _update_host(session, host_id, **values)
    state = host_state(row)
    await add_event(session, ev.HostCordoned.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.host.drain" if drain else "allocations.host.cordon",
        resource_type="host",
        resource_id=host_id,
        before={"status": before.status},
        after={"status": row.status},
        reason=reason,
    )
    if drain:
        live = await session.execute(
            select(allocations.c.allocation_id).where(
                allocations.c.host_id == host_id,
                allocations.c.status.in_([S.active, S.restarting, S.resizing]),
            )
        )
        for (alloc_id,) in live:
            await _request_release(session, principal.actor, alloc_id, reason=f"host drained: {reason}")
    return state


async def uncordon_host(session: AsyncSession, principal: Principal, host_id: uuid.UUID) -> HostState:
    await iam.authorize(session, principal, "allocations.host.manage")
    before = await get_host(session, host_id, lock=True)
    if before.status == HostStatus.unreachable:
        row = await _update_host(session, host_id, cordon_reason=None, status_before_unreachable=HostStatus.ready)
    elif before.status == HostStatus.cordoned:
        row = await _update_host(session, host_id, cordon_reason=None, status=HostStatus.ready)
    else:
        raise Conflict(f"the host is {before.status}, not cordoned", code="host_not_cordoned")
    state = host_state(row)
    await add_event(session, ev.HostUpdated.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.host.uncordon",
        resource_type="host",
        resource_id=host_id,
        before={"status": before.status},
        after={"status": row.status},
    )
    return state


# --------------------------------------------------------------------------------------------- agents


async def host_by_token(session: AsyncSession, token: str | None, *, lock: bool = False) -> Any:
    if not token or not token.startswith("gpn_"):
        raise Unauthorized("a node token is required", code="invalid_node_token")
    q = select(hosts).where(hosts.c.node_token_hash == hash_token(token))
    row = (await session.execute(q.with_for_update() if lock else q)).first()
    if row is None or row.status == HostStatus.decommissioned:
        raise Unauthorized("unknown or revoked node token", code="invalid_node_token")
    return row


async def register_agent(
    session: AsyncSession,
    token: str | None,
    *,
    agent_version: str,
    gpus: list[GpuDevice],
    inventory_source: str,
    ssh_host: str,
    ssh_port: int,
) -> HostState:
    """The agent (re)starts: inventory, endpoint; the host becomes `ready` (or returns from
    `unreachable`). Tasks it had leased are handed out again at once: a restarted agent replays
    its journal for the ones it had finished, so nothing is lost and nothing runs twice."""
    host = await host_by_token(session, token, lock=True)
    status = host.status
    if status == HostStatus.enrolling:
        status = HostStatus.ready
    elif status == HostStatus.unreachable:
        status = host.status_before_unreachable or HostStatus.ready
    row = await _update_host(
        session,
        host.host_id,
        status=status,
        agent_version=agent_version,
        inventory_source=inventory_source,
        gpus=[g.model_dump(mode="json") for g in gpus],
        ssh_host=ssh_host,
        ssh_port=ssh_port,
        last_heartbeat_at=now(),
        status_before_unreachable=None,
    )
    await session.execute(
        update(agent_tasks)
        .where(agent_tasks.c.host_id == host.host_id, agent_tasks.c.status == "leased")
        .values(status="pending", lease_token=None, lease_expires_at=None)
    )
    state = host_state(row)
    await add_event(session, ev.HostUpdated.build(data=state, source=SERVICE, actor=SYSTEM))
    await audit.record(
        session,
        service=SERVICE,
        actor=SYSTEM,
        action="allocations.host.register",
        resource_type="host",
        resource_id=host.host_id,
        before={"status": host.status},
        after={"status": status, "gpus": len(gpus), "agent_version": agent_version},
    )
    if host.status == HostStatus.unreachable:
        await _set_attention_for_host(session, host.host_id, None)
    return state


async def heartbeat(session: AsyncSession, token: str | None) -> Any:
    host = await host_by_token(session, token, lock=True)
    if host.status == HostStatus.unreachable:
        row = await _update_host(
            session,
            host.host_id,
            status=host.status_before_unreachable or HostStatus.ready,
            status_before_unreachable=None,
            last_heartbeat_at=now(),
        )
        await add_event(session, ev.HostUpdated.build(data=host_state(row), source=SERVICE, actor=SYSTEM))
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
        return row
    await session.execute(update(hosts).where(hosts.c.host_id == host.host_id).values(last_heartbeat_at=now()))
    return host


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
        row = await _update_host(
            session, host.host_id, status=HostStatus.unreachable, status_before_unreachable=host.status
        )
        await add_event(session, ev.HostHeartbeatLost.build(data=host_state(row), source=SERVICE, actor=SYSTEM))
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
    return lost


async def _set_attention_for_host(session: AsyncSession, host_id: uuid.UUID, attention: str | None) -> None:
    rows = await session.execute(
        select(allocations.c.allocation_id)
        .where(allocations.c.host_id == host_id, allocations.c.status.notin_([S.released, S.failed]))
        .with_for_update()
    )
    for (alloc_id,) in rows:
        row = await _update_alloc(session, alloc_id, attention=attention)
        await add_event(
            session, ev.AllocationAttentionChanged.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM)
        )
        await _timeline(
            session,
            alloc_id,
            "host",
            "failed" if attention else "succeeded",
            attention or "the host's agent reports again",
        )


async def claim_tasks(session: AsyncSession, host_id: uuid.UUID, *, lease_s: float, limit: int = 20) -> list[Any]:
    """Lease the host's next pending tasks, in the order they were queued."""
    pick = (
        select(agent_tasks.c.task_id)
        .where(agent_tasks.c.host_id == host_id, agent_tasks.c.status == "pending")
        .order_by(agent_tasks.c.seq)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    rows = await session.execute(
        update(agent_tasks)
        .where(agent_tasks.c.task_id.in_(pick.scalar_subquery()))
        .values(
            status="leased",
            lease_token=uuid.uuid4(),
            lease_expires_at=now() + timedelta(seconds=lease_s),
            attempts=agent_tasks.c.attempts + 1,
        )
        .returning(*agent_tasks.c)
    )
    return sorted(rows.all(), key=lambda r: r.seq)


async def requeue_expired_tasks(session: AsyncSession) -> int:
    res = await session.execute(
        update(agent_tasks)
        .where(agent_tasks.c.status == "leased", agent_tasks.c.lease_expires_at < now())
        .values(status="pending", lease_token=None, lease_expires_at=None)
    )
    return res.rowcount or 0


async def _task_for_host(session: AsyncSession, host_id: uuid.UUID, task_id: uuid.UUID) -> Any:
    row = (
        await session.execute(
            select(agent_tasks)
            .where(agent_tasks.c.task_id == task_id, agent_tasks.c.host_id == host_id)
            .with_for_update()
        )
    ).first()
    if row is None:
        raise NotFound("task not found", code="task_not_found")
    return row


async def report_progress(
    session: AsyncSession,
    host_id: uuid.UUID,
    task_id: uuid.UUID,
    *,
    phase: str,
    status: str,
    message: str,
    started_at: datetime | None,
    finished_at: datetime | None,
    lease_s: float,
) -> None:
    task = await _task_for_host(session, host_id, task_id)
    if task.status in ("succeeded", "failed"):
        return
    await session.execute(
        update(agent_tasks)
        .where(agent_tasks.c.task_id == task_id)
        .values(lease_expires_at=now() + timedelta(seconds=lease_s))
    )
    if task.allocation_id:
        await _timeline(
            session,
            task.allocation_id,
            f"{task.kind}.{phase}",
            status,
            message,
            task_id=task_id,
            started_at=started_at,
            finished_at=finished_at,
        )


async def complete_task(
    session: AsyncSession, host_id: uuid.UUID, task_id: uuid.UUID, *, ok: bool, message: str, result: dict[str, Any]
) -> bool:
    """Apply a task's outcome once; a repeated report (agent retry, journal replay) is a no-op."""
    task = await _task_for_host(session, host_id, task_id)
    if task.status in ("succeeded", "failed"):
        return False
    await session.execute(
        update(agent_tasks)
        .where(agent_tasks.c.task_id == task_id)
        .values(
            status="succeeded" if ok else "failed",
            result=result,
            error=None if ok else message,
            finished_at=now(),
            lease_token=None,
            lease_expires_at=None,
        )
    )
    if task.allocation_id is None:
        return True
    alloc = (
        await session.execute(
            select(allocations).where(allocations.c.allocation_id == task.allocation_id).with_for_update()
        )
    ).first()
    if alloc is None:
        return True
    await _timeline(
        session,
        alloc.allocation_id,
        task.kind,
        "succeeded" if ok else "failed",
        message or ("done" if ok else "failed"),
        task_id=task_id,
        started_at=task.created_at,
    )
    handler = _OUTCOMES.get(task.kind)
    if handler is not None:
        await handler(session, alloc, task, ok, message, result)
    return True


async def _on_provision(
    session: AsyncSession, alloc: Any, task: Any, ok: bool, message: str, result: dict[str, Any]
) -> None:
    if alloc.status != S.provisioning:
        return
    if ok:
        host = await get_host(session, alloc.host_id)
        t = now()
        row = await _transition(
            session,
            alloc,
            S.active,
            activated_at=t,
            ssh_host=result.get("ssh_host") or host.ssh_host,
            ssh_port=result.get("ssh_port") or host.ssh_port,
            failure_reason=None,
        )
        await add_event(session, ev.AllocationActivated.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM))
    else:
        await _free_capacity(session, alloc.allocation_id)
        await _detach_all(session, alloc.allocation_id, deleting=False)
        row = await _transition(session, alloc, S.failed, failure_reason=message or "provisioning failed")
        await add_event(session, ev.AllocationFailed.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM))


async def _on_restart(
    session: AsyncSession, alloc: Any, task: Any, ok: bool, message: str, result: dict[str, Any]
) -> None:
    if alloc.status != S.restarting:
        return
    if ok:
        row = await _transition(session, alloc, S.active, failure_reason=None)
        await add_event(session, ev.AllocationRestarted.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM))
    else:
        row = await _transition(session, alloc, S.active, failure_reason=f"restart failed: {message}")
        await add_event(session, ev.AllocationRestartFailed.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM))


async def _on_resize(
    session: AsyncSession, alloc: Any, task: Any, ok: bool, message: str, result: dict[str, Any]
) -> None:
    if alloc.status != S.resizing:
        return
    target = list(alloc.target_gpu_indices or [])
    keep = target if ok else list(alloc.gpu_indices)
    await session.execute(
        delete(gpu_assignments).where(
            gpu_assignments.c.allocation_id == alloc.allocation_id, gpu_assignments.c.gpu_index.notin_(keep)
        )
    )
    if ok:
        row = await _transition(
            session,
            alloc,
            S.active,
            gpu_count=len(target),
            gpu_indices=target,
            target_gpu_count=None,
            target_gpu_indices=None,
            failure_reason=None,
        )
        await add_event(session, ev.AllocationResized.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM))
    else:
        row = await _transition(
            session,
            alloc,
            S.active,
            target_gpu_count=None,
            target_gpu_indices=None,
            failure_reason=f"resize failed: {message}",
        )
        await add_event(session, ev.AllocationResizeFailed.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM))


async def _on_release(
    session: AsyncSession, alloc: Any, task: Any, ok: bool, message: str, result: dict[str, Any]
) -> None:
    if alloc.status != S.releasing:
        return
    if ok:
        await _free_capacity(session, alloc.allocation_id)
        await _detach_all(session, alloc.allocation_id, deleting=True)
        row = await _transition(
            session,
            alloc,
            S.released,
            released_at=now(),
            failure_reason=None,
            target_gpu_count=None,
            target_gpu_indices=None,
        )
        await add_event(session, ev.AllocationReleased.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM))
    else:
        row = await _transition(session, alloc, S.release_failed, failure_reason=message or "release failed")
        await add_event(session, ev.AllocationReleaseFailed.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM))


_OUTCOMES = {"provision": _on_provision, "restart": _on_restart, "resize": _on_resize, "release": _on_release}


# ------------------------------------------------------------------------------------------- allocations


def alloc_state(row: Any) -> AllocationState:
    endpoint = (
        SshEndpoint(host=row.ssh_host, port=row.ssh_port, username=row.ssh_username)
        if row.ssh_host and row.ssh_port and row.status not in (S.released, S.failed)
        else None
    )
    return AllocationState(
        allocation_id=row.allocation_id,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        owner_user_id=row.owner_user_id,
        name=row.name,
        shape=row.shape,
        gpu_model=row.gpu_model,
        gpu_count=row.gpu_count,
        gpu_indices=list(row.gpu_indices),
        host_id=row.host_id,
        host_class=row.host_class,
        status=row.status,
        status_changed_at=row.status_changed_at,
        failure_reason=row.failure_reason,
        target_gpu_count=row.target_gpu_count,
        ssh_endpoint=endpoint,
        volume_ids=list(getattr(row, "volume_ids", [])),
        requested_at=row.requested_at,
        activated_at=row.activated_at,
        release_requested_at=row.release_requested_at,
        billing_stopped_at=row.billing_stopped_at,
        released_at=row.released_at,
        release_attempts=row.release_attempts,
        attention=row.attention,
        version=row.version,
    )


class _Row(dict):  # type: ignore[type-arg]
    """A row with the allocation's attached volume ids added (events carry them)."""

    __getattr__ = dict.__getitem__


async def _with_volumes(session: AsyncSession, row: Any) -> Any:
    return (await _with_volumes_many(session, [row]))[0]


async def _with_volumes_many(session: AsyncSession, rows: list[Any]) -> list[Any]:
    """Each row with its attached volume ids (in attach order), in one query for the whole list."""
    attached: dict[uuid.UUID, list[uuid.UUID]] = {r.allocation_id: [] for r in rows}
    if rows:
        result = await session.execute(
            select(volume_attachments.c.allocation_id, volume_attachments.c.volume_id)
            .where(volume_attachments.c.allocation_id.in_(list(attached)))
            .order_by(volume_attachments.c.attached_at)
        )
        for alloc_id, volume_id in result.all():
            attached[alloc_id].append(volume_id)
    return [_Row({**r._mapping, "volume_ids": attached[r.allocation_id]}) for r in rows]


async def _update_alloc(session: AsyncSession, alloc_id: uuid.UUID, **values: Any) -> Any:
    row = (
        await session.execute(
            update(allocations)
            .where(allocations.c.allocation_id == alloc_id)
            .values(version=allocations.c.version + 1, **values)
            .returning(*allocations.c)
        )
    ).one()
    return await _with_volumes(session, row)


async def _transition(session: AsyncSession, alloc: Any, target: S, **values: Any) -> Any:
    domain.check_transition(alloc.status, target, action=target.value)
    row = await _update_alloc(session, alloc.allocation_id, status=target, status_changed_at=now(), **values)
    await _timeline(
        session,
        alloc.allocation_id,
        "status",
        "info",
        f"{alloc.status} → {target.value}" + (f": {values['failure_reason']}" if values.get("failure_reason") else ""),
    )
    return row


async def _timeline(
    session: AsyncSession,
    alloc_id: uuid.UUID,
    phase: str,
    status: str,
    message: str,
    *,
    task_id: uuid.UUID | None = None,
    started_at: datetime | None = None,
    finished_at: datetime | None = None,
) -> None:
    t = now()
    await session.execute(
        insert(timeline).values(
            entry_id=new_event_id(),
            allocation_id=alloc_id,
            phase=phase,
            status=status,
            message=message[:2000],
            task_id=task_id,
            started_at=started_at or t,
            finished_at=finished_at or (None if status == "started" else t),
        )
    )


async def _enqueue(
    session: AsyncSession, host_id: uuid.UUID, alloc_id: uuid.UUID | None, kind: str, payload: dict[str, Any]
) -> uuid.UUID:
    task_id = new_event_id()
    await session.execute(
        insert(agent_tasks).values(
            task_id=task_id, host_id=host_id, allocation_id=alloc_id, kind=kind, payload=payload, status="pending"
        )
    )
    if alloc_id is not None:
        await _timeline(session, alloc_id, kind, "started", f"{kind} queued for the host agent", task_id=task_id)
    await session.execute(text("SELECT pg_notify('allocations_tasks', :h)"), {"h": str(host_id)})
    return task_id


async def _free_capacity(session: AsyncSession, alloc_id: uuid.UUID) -> None:
    await session.execute(delete(gpu_assignments).where(gpu_assignments.c.allocation_id == alloc_id))


async def authorized_keys(session: AsyncSession, alloc: Any) -> list[str]:
    """The owner's personal keys and the active grants' keys: what the agent installs."""
    keys: list[str] = []
    if alloc.owner_user_id:
        keys += (
            (
                await session.execute(
                    select(ssh_keys.c.public_key)
                    .where(ssh_keys.c.user_id == alloc.owner_user_id)
                    .order_by(ssh_keys.c.created_at)
                )
            )
            .scalars()
            .all()
        )
    keys += (
        (
            await session.execute(
                select(ssh_grants.c.public_key)
                .where(ssh_grants.c.allocation_id == alloc.allocation_id, ssh_grants.c.status == "active")
                .order_by(ssh_grants.c.created_at)
            )
        )
        .scalars()
        .all()
    )
    return list(dict.fromkeys(keys))


async def _volume_mounts(session: AsyncSession, alloc_id: uuid.UUID) -> list[dict[str, Any]]:
    rows = await session.execute(
        select(volume_attachments.c.volume_id, volume_attachments.c.mount_path).where(
            volume_attachments.c.allocation_id == alloc_id
        )
    )
    return [{"volume_id": str(r.volume_id), "mount_path": r.mount_path} for r in rows]


async def _project_gpu_usage(session: AsyncSession, project_id: uuid.UUID) -> int:
    used = await session.execute(
        select(
            func.coalesce(
                func.sum(func.greatest(allocations.c.gpu_count, func.coalesce(allocations.c.target_gpu_count, 0))), 0
            )
        ).where(allocations.c.project_id == project_id, allocations.c.status.in_(list(domain.HOLDS_CAPACITY)))
    )
    return int(used.scalar_one())


async def _check_quota(session: AsyncSession, project_id: uuid.UUID, extra: int) -> None:
    """Serialise GPU-holding changes of one project (advisory lock), then check its quota."""
    if (await session.execute(select(quotas.c.max_gpus).where(quotas.c.project_id == project_id))).first() is None:
        return  # no quota: nothing to serialise
    await session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:p, 7))"), {"p": str(project_id)})
    q = (await session.execute(select(quotas.c.max_gpus).where(quotas.c.project_id == project_id))).one()
    used = await _project_gpu_usage(session, project_id)
    if used + extra > q.max_gpus:
        raise Conflict(
            f"the project's GPU quota is {q.max_gpus}; {used} are in use and {extra} more were asked for",
            code="quota_exceeded",
            quota=q.max_gpus,
            in_use=used,
            requested=extra,
        )


async def _capacities(session: AsyncSession, host_ids: list[uuid.UUID] | None = None) -> list[domain.HostCapacity]:
    q = select(hosts.c.host_id, hosts.c.name, hosts.c.status, hosts.c.host_class, hosts.c.gpus)
    if host_ids is not None:
        q = q.where(hosts.c.host_id.in_(host_ids))
    host_rows = (await session.execute(q)).all()
    used_rows = await session.execute(select(gpu_assignments.c.host_id, gpu_assignments.c.gpu_index))
    used: dict[uuid.UUID, set[int]] = {}
    for r in used_rows:
        used.setdefault(r.host_id, set()).add(r.gpu_index)
    out = []
    for h in host_rows:
        by_model: dict[str, list[int]] = {}
        for g in h.gpus:
            by_model.setdefault(g["model"], []).append(g["index"])
        out.append(
            domain.HostCapacity(
                h.host_id, h.name, h.status, h.host_class, by_model, frozenset(used.get(h.host_id, set()))
            )
        )
    return out


async def _place(
    session: AsyncSession,
    *,
    shape: CapacityShape,
    model: str,
    count: int | None,
    host_class: str | None,
    alloc_id: uuid.UUID,
) -> tuple[Any, list[int]]:
    """Pick a host and reserve GPUs on it. Host rows are locked one at a time and capacity is
    re-read under the lock, so concurrent creates queue and never double-book (the primary key
    of gpu_assignments is the last line of defence)."""
    snapshot = await _capacities(session)
    if not any(model in h.gpu_indices_by_model for h in snapshot if h.status != HostStatus.decommissioned):
        known = sorted({m for h in snapshot for m in h.gpu_indices_by_model})
        raise Unprocessable(
            f"no host offers GPU model {model!r}; known models: {', '.join(known) or 'none'}", code="unknown_gpu_model"
        )
    want = count or 1
    # Pass 1 skips hosts other requests hold, so concurrent creates spread over hosts; pass 2 waits.
    for skip_locked in (True, False):
        for cand in domain.candidates(snapshot, shape=shape, model=model, count=want, host_class=host_class):
            lock = select(hosts).where(hosts.c.host_id == cand.host_id).with_for_update(skip_locked=skip_locked)
            host = (await session.execute(lock)).first()
            if host is None or host.status != HostStatus.ready:
                continue
            fresh = (await _capacities(session, [cand.host_id]))[0]
            picked = domain.pick_gpus(fresh, shape=shape, model=model, count=want)
            if picked is None or (shape is CapacityShape.baremetal and count and count != len(picked)):
                continue
            await session.execute(
                insert(gpu_assignments),
                [{"host_id": host.host_id, "gpu_index": i, "allocation_id": alloc_id} for i in picked],
            )
            return host, picked
        snapshot = await _capacities(session)
    what = f"a whole {model} host" if shape is CapacityShape.baremetal else f"{want} free {model} GPUs on one host"
    raise Conflict(
        f"no ready host has {what}" + (f" in class {host_class!r}" if host_class else ""), code="insufficient_capacity"
    )


async def create_allocation(
    session: AsyncSession,
    principal: Principal,
    *,
    project_id: uuid.UUID,
    name: str,
    shape: CapacityShape,
    gpu_model: str,
    gpu_count: int | None,
    host_class: str | None,
    volume_ids: list[uuid.UUID],
) -> Any:
    await iam.authorize(session, principal, "allocations.create", project_id=project_id)
    tenant_id = await iam.project_tenant(session, project_id)
    assert tenant_id is not None
    if shape is CapacityShape.gpu_slice and not gpu_count:
        raise Unprocessable("gpu_count is required for a gpu_slice", code="gpu_count_required")
    await _check_quota(session, project_id, gpu_count or 1)
    alloc_id = new_event_id()
    t = now()
    # Insert first (requested) so the GPU reservations can reference it; all in this transaction.
    await session.execute(
        insert(allocations).values(
            allocation_id=alloc_id,
            tenant_id=tenant_id,
            project_id=project_id,
            owner_user_id=None if principal.is_service_account else principal.subject,
            name=name,
            shape=shape,
            gpu_model=gpu_model,
            gpu_count=gpu_count or 1,
            gpu_indices=[],
            host_class=host_class,
            status=S.requested,
            status_changed_at=t,
            ssh_username=domain.unix_username(alloc_id),
            requested_at=t,
        )
    )
    host, picked = await _place(
        session, shape=shape, model=gpu_model, count=gpu_count, host_class=host_class, alloc_id=alloc_id
    )
    if len(picked) != (gpu_count or 1):  # a whole host: its GPU count is known only now
        await session.execute(
            update(allocations).where(allocations.c.allocation_id == alloc_id).values(gpu_count=len(picked))
        )
        await _check_quota(session, project_id, 0)
    requested = await _with_volumes(
        session, (await session.execute(select(allocations).where(allocations.c.allocation_id == alloc_id))).one()
    )
    events: list[Event] = [
        ev.AllocationRequested.build(data=alloc_state(requested), source=SERVICE, actor=principal.actor)
    ]
    await _timeline(session, alloc_id, "status", "info", "requested")
    for vid in volume_ids:
        await _attach(session, principal, alloc_id, project_id, vid, emit_task=False)
    row = await _transition(
        session, requested, S.provisioning, host_id=host.host_id, gpu_indices=picked, gpu_count=len(picked)
    )
    await _timeline(
        session, alloc_id, "placement", "succeeded", f"placed on {host.name}: GPUs {','.join(map(str, picked))}"
    )
    events.append(ev.AllocationProvisioning.build(data=alloc_state(row), source=SERVICE, actor=principal.actor))
    await add_events(session, events)
    await _enqueue(
        session,
        host.host_id,
        alloc_id,
        "provision",
        {
            "allocation_id": str(alloc_id),
            "username": row.ssh_username,
            "gpu_indices": picked,
            "authorized_keys": await authorized_keys(session, row),
            "volumes": await _volume_mounts(session, alloc_id),
        },
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.create",
        resource_type="allocation",
        resource_id=alloc_id,
        tenant_id=tenant_id,
        project_id=project_id,
        after=alloc_state(row).model_dump(mode="json"),
    )
    return row


async def load_allocation(
    session: AsyncSession, principal: Principal, alloc_id: uuid.UUID, action: str, *, lock: bool = False
) -> Any:
    row = (await session.execute(select(allocations).where(allocations.c.allocation_id == alloc_id))).first()
    if row is None:
        raise NotFound("allocation not found", code="allocation_not_found")
    try:
        await iam.authorize(session, principal, action, project_id=row.project_id)
    except NotFound:
        raise NotFound("allocation not found", code="allocation_not_found") from None
    if lock:
        row = (
            await session.execute(select(allocations).where(allocations.c.allocation_id == alloc_id).with_for_update())
        ).one()
    return await _with_volumes(session, row)


async def list_allocations(
    session: AsyncSession, principal: Principal, *, project_id: uuid.UUID | None, include_released: bool
) -> list[Any]:
    q = select(allocations).order_by(allocations.c.requested_at.desc()).limit(500)
    if project_id is not None:
        await iam.authorize(session, principal, "allocations.read", project_id=project_id)
        q = q.where(allocations.c.project_id == project_id)
    else:
        visible = await iam.visible_project_ids(session, principal)
        if visible is not None:
            q = q.where(allocations.c.project_id.in_(visible or [uuid.UUID(int=0)]))
    if not include_released:
        q = q.where(allocations.c.status.notin_([S.released, S.failed]))
    return await _with_volumes_many(session, list((await session.execute(q)).all()))


async def restart_allocation(session: AsyncSession, principal: Principal, alloc_id: uuid.UUID) -> Any:
    alloc = await load_allocation(session, principal, alloc_id, "allocations.update", lock=True)
    before = alloc_state(alloc)
    row = await _transition(session, alloc, S.restarting, failure_reason=None)
    await add_event(
        session, ev.AllocationRestarting.build(data=alloc_state(row), source=SERVICE, actor=principal.actor)
    )
    await _enqueue(
        session,
        row.host_id,
        alloc_id,
        "restart",
        {
            "allocation_id": str(alloc_id),
            "username": row.ssh_username,
            "gpu_indices": list(row.gpu_indices),
            "authorized_keys": await authorized_keys(session, row),
            "volumes": await _volume_mounts(session, alloc_id),
        },
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.restart",
        resource_type="allocation",
        resource_id=alloc_id,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        before={"status": before.status},
        after={"status": row.status},
    )
    return row


async def resize_allocation(session: AsyncSession, principal: Principal, alloc_id: uuid.UUID, gpu_count: int) -> Any:
    alloc = await load_allocation(session, principal, alloc_id, "allocations.update", lock=True)
    if alloc.shape != CapacityShape.gpu_slice:
        raise Conflict(
            "only a gpu_slice can be resized; a baremetal allocation holds the whole host", code="resize_not_supported"
        )
    domain.check_transition(alloc.status, S.resizing, action="resize")
    if gpu_count == alloc.gpu_count:
        raise Conflict(f"the allocation already has {gpu_count} GPUs", code="resize_noop")
    current = sorted(alloc.gpu_indices)
    if gpu_count > alloc.gpu_count:
        await _check_quota(session, alloc.project_id, gpu_count - alloc.gpu_count)
        await session.execute(select(hosts.c.host_id).where(hosts.c.host_id == alloc.host_id).with_for_update())
        cap = (await _capacities(session, [alloc.host_id]))[0]
        free = cap.free(alloc.gpu_model)
        need = gpu_count - alloc.gpu_count
        if len(free) < need:
            raise Conflict(
                f"the host has {len(free)} free {alloc.gpu_model} GPUs; growing to {gpu_count} needs {need}",
                code="insufficient_gpus_on_host",
                free=len(free),
                needed=need,
            )
        extra = sorted(free)[:need]
        await session.execute(
            insert(gpu_assignments),
            [{"host_id": alloc.host_id, "gpu_index": i, "allocation_id": alloc_id} for i in extra],
        )
        target = sorted(current + extra)
    else:
        target = current[:gpu_count]
    row = await _transition(
        session, alloc, S.resizing, target_gpu_count=gpu_count, target_gpu_indices=target, failure_reason=None
    )
    await add_event(session, ev.AllocationResizing.build(data=alloc_state(row), source=SERVICE, actor=principal.actor))
    await _enqueue(
        session,
        row.host_id,
        alloc_id,
        "resize",
        {
            "allocation_id": str(alloc_id),
            "username": row.ssh_username,
            "gpu_indices": target,
        },
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.resize",
        resource_type="allocation",
        resource_id=alloc_id,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        before={"gpu_count": alloc.gpu_count, "gpu_indices": current},
        after={"gpu_count": gpu_count, "gpu_indices": target},
    )
    return row


async def live_app_members(session: AsyncSession, alloc_id: uuid.UUID) -> int:
    return int(
        (
            await session.execute(
                select(func.count())
                .select_from(app_members)
                .where(
                    app_members.c.allocation_id == alloc_id,
                    app_members.c.tombstoned.is_(False),
                    app_members.c.status.in_(LIVE_MEMBER),
                )
            )
        ).scalar_one()
    )


async def release_allocation(session: AsyncSession, principal: Principal, alloc_id: uuid.UUID, *, retry: bool) -> Any:
    action = "allocations.release"
    alloc = await load_allocation(session, principal, alloc_id, action, lock=True)
    if retry and alloc.status != S.release_failed:
        raise Conflict(
            f"only a release_failed allocation can be retried; this one is {alloc.status}",
            code="invalid_state_transition",
            current_status=alloc.status,
        )
    if not retry and alloc.status == S.release_failed:
        raise Conflict("the release failed; use retry-release", code="release_failed_use_retry")
    row = await _request_release(session, principal.actor, alloc_id, reason=None)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.release_retry" if retry else action,
        resource_type="allocation",
        resource_id=alloc_id,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        before={"status": alloc.status},
        after={"status": row.status},
    )
    return row


async def _request_release(session: AsyncSession, actor: Actor, alloc_id: uuid.UUID, *, reason: str | None) -> Any:
    alloc = (
        await session.execute(select(allocations).where(allocations.c.allocation_id == alloc_id).with_for_update())
    ).one()
    retry = alloc.status == S.release_failed
    t = now()
    # Billing stops at the first release request, whatever happens to the release afterwards.
    row = await _transition(
        session,
        alloc,
        S.releasing,
        release_requested_at=alloc.release_requested_at or t,
        billing_stopped_at=alloc.billing_stopped_at or t,
        release_attempts=alloc.release_attempts + 1,
        failure_reason=None,
    )
    if reason:
        await _timeline(session, alloc_id, "release", "info", reason)
    await add_event(session, ev.AllocationReleaseRequested.build(data=alloc_state(row), source=SERVICE, actor=actor))
    members = 0 if retry else await live_app_members(session, alloc_id)
    if members:
        row = await _update_alloc(session, alloc_id, awaiting_clearance_since=t)
        await _timeline(
            session,
            alloc_id,
            "release.clearance",
            "started",
            f"waiting for app-runtime to stop {members} app member(s) on this allocation",
        )
    else:
        await enqueue_release(session, row)
    return row


async def enqueue_release(session: AsyncSession, alloc: Any) -> None:
    vols = []
    for a in (
        await session.execute(
            select(volume_attachments.c.volume_id, volumes.c.persist)
            .join(volumes)
            .where(volume_attachments.c.allocation_id == alloc.allocation_id)
        )
    ).all():
        others = (
            await session.execute(
                select(func.count())
                .select_from(volume_attachments)
                .where(
                    volume_attachments.c.volume_id == a.volume_id,
                    volume_attachments.c.allocation_id != alloc.allocation_id,
                )
            )
        ).scalar_one()
        vols.append({"volume_id": str(a.volume_id), "delete_data": not a.persist and not others})
    await _enqueue(
        session,
        alloc.host_id,
        alloc.allocation_id,
        "release",
        {
            "allocation_id": str(alloc.allocation_id),
            "username": alloc.ssh_username,
            "volumes": vols,
        },
    )


async def clearance_granted(session: AsyncSession, alloc_id: uuid.UUID, *, forced: bool, note: str) -> None:
    alloc = (
        await session.execute(select(allocations).where(allocations.c.allocation_id == alloc_id).with_for_update())
    ).first()
    if alloc is None or alloc.status != S.releasing or alloc.awaiting_clearance_since is None:
        return
    row = await _update_alloc(session, alloc_id, awaiting_clearance_since=None)
    await _timeline(session, alloc_id, "release.clearance", "failed" if forced else "succeeded", note)
    await enqueue_release(session, row)


async def overdue_clearances(session: AsyncSession, timeout_s: float) -> list[uuid.UUID]:
    rows = await session.execute(
        select(allocations.c.allocation_id).where(
            allocations.c.awaiting_clearance_since < now() - timedelta(seconds=timeout_s),
            allocations.c.status == S.releasing,
        )
    )
    return [r[0] for r in rows]


# ---------------------------------------------------------------------------------------------- timeline


async def timeline_entries(session: AsyncSession, alloc_id: uuid.UUID, after_seq: int = 0) -> list[dict[str, Any]]:
    rows = await session.execute(
        select(timeline)
        .where(timeline.c.allocation_id == alloc_id, timeline.c.seq > after_seq)
        .order_by(timeline.c.seq)
    )
    return [dict(r._mapping) for r in rows]


# ---------------------------------------------------------------------------------------------- SSH keys


async def add_ssh_key(session: AsyncSession, principal: Principal, *, name: str, public_key: str) -> Any:
    if principal.is_service_account:
        raise Forbidden("personal SSH keys belong to users", code="users_only")
    line, fp = domain.parse_public_key(public_key)
    exists = (
        await session.execute(
            select(ssh_keys.c.key_id).where(ssh_keys.c.user_id == principal.subject, ssh_keys.c.fingerprint == fp)
        )
    ).first()
    if exists:
        raise Conflict("you already registered this key", code="ssh_key_exists", key_id=str(exists[0]))
    key_id = new_event_id()
    row = (
        await session.execute(
            insert(ssh_keys)
            .values(key_id=key_id, user_id=principal.subject, name=name, public_key=line, fingerprint=fp)
            .returning(*ssh_keys.c)
        )
    ).one()
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.ssh_key.add",
        resource_type="ssh_key",
        resource_id=key_id,
        after={"name": name, "fingerprint": fp},
    )
    await _sync_owner_allocations(session, principal.subject)
    return row


async def list_ssh_keys(session: AsyncSession, principal: Principal) -> list[Any]:
    return list(
        (
            await session.execute(
                select(ssh_keys).where(ssh_keys.c.user_id == principal.subject).order_by(ssh_keys.c.created_at)
            )
        ).all()
    )


async def delete_ssh_key(session: AsyncSession, principal: Principal, key_id: uuid.UUID) -> None:
    row = (
        await session.execute(
            delete(ssh_keys)
            .where(ssh_keys.c.key_id == key_id, ssh_keys.c.user_id == principal.subject)
            .returning(ssh_keys.c.fingerprint)
        )
    ).first()
    if row is None:
        raise NotFound("SSH key not found", code="ssh_key_not_found")
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.ssh_key.delete",
        resource_type="ssh_key",
        resource_id=key_id,
        before={"fingerprint": row.fingerprint},
    )
    await _sync_owner_allocations(session, principal.subject)


SYNCABLE = (S.provisioning, S.active, S.restarting, S.resizing)


async def _sync_owner_allocations(session: AsyncSession, user_id: uuid.UUID) -> None:
    rows = await session.execute(
        select(allocations).where(allocations.c.owner_user_id == user_id, allocations.c.status.in_(SYNCABLE))
    )
    for row in rows.all():
        await sync_keys(session, row)


async def sync_keys(session: AsyncSession, alloc: Any) -> None:
    if alloc.status not in SYNCABLE or alloc.host_id is None:
        return
    await _enqueue(
        session,
        alloc.host_id,
        alloc.allocation_id,
        "sync_ssh_keys",
        {
            "allocation_id": str(alloc.allocation_id),
            "username": alloc.ssh_username,
            "authorized_keys": await authorized_keys(session, alloc),
        },
    )


def grant_state(row: Any) -> SshGrantState:
    return SshGrantState.model_validate(dict(row._mapping))


async def _is_project_member(
    session: AsyncSession, user_id: uuid.UUID, tenant_id: uuid.UUID, project_id: uuid.UUID
) -> bool:
    row = (
        await session.execute(
            select(iam_memberships.c.membership_id)
            .where(
                iam_memberships.c.user_id == user_id,
                iam_memberships.c.revoked.is_(False),
                or_(
                    and_(
                        iam_memberships.c.scope == MembershipScope.project, iam_memberships.c.project_id == project_id
                    ),
                    and_(iam_memberships.c.scope == MembershipScope.tenant, iam_memberships.c.tenant_id == tenant_id),
                ),
            )
            .limit(1)
        )
    ).first()
    return row is not None


async def create_grant(
    session: AsyncSession, principal: Principal, alloc_id: uuid.UUID, *, user_id: uuid.UUID, public_key: str
) -> Any:
    """The allocation's owner or a project admin gives another project member SSH access with the
    member's own public key."""
    alloc = await load_allocation(session, principal, alloc_id, "allocations.read", lock=True)
    if alloc.owner_user_id != principal.subject:
        await iam.authorize(session, principal, "allocations.ssh_grant.manage", project_id=alloc.project_id)
    if alloc.status not in SYNCABLE:
        raise Conflict(f"the allocation is {alloc.status}", code="allocation_not_active")
    if not await _is_project_member(session, user_id, alloc.tenant_id, alloc.project_id):
        raise Unprocessable("the grantee is not a member of the allocation's project", code="grantee_not_member")
    line, fp = domain.parse_public_key(public_key)
    dup = (
        await session.execute(
            select(ssh_grants.c.grant_id).where(
                ssh_grants.c.allocation_id == alloc_id, ssh_grants.c.fingerprint == fp, ssh_grants.c.status == "active"
            )
        )
    ).first()
    if dup:
        raise Conflict("this key already has an active grant on the allocation", code="ssh_grant_exists")
    grant_id = new_event_id()
    row = (
        await session.execute(
            insert(ssh_grants)
            .values(
                grant_id=grant_id,
                allocation_id=alloc_id,
                tenant_id=alloc.tenant_id,
                project_id=alloc.project_id,
                origin="user",
                user_id=user_id,
                public_key=line,
                fingerprint=fp,
                status="active",
                granted_by=str(principal.subject),
                created_at=now(),
                version=1,
            )
            .returning(*ssh_grants.c)
        )
    ).one()
    state = grant_state(row)
    await add_event(session, ev.SshGrantCreated.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.ssh_grant.create",
        resource_type="ssh_grant",
        resource_id=grant_id,
        tenant_id=alloc.tenant_id,
        project_id=alloc.project_id,
        after={"allocation_id": str(alloc_id), "user_id": str(user_id), "fingerprint": fp},
    )
    await _timeline(session, alloc_id, "access", "info", f"SSH access granted to user {user_id} ({fp})")
    await sync_keys(session, alloc)
    return row


async def list_grants(session: AsyncSession, principal: Principal, alloc_id: uuid.UUID) -> list[Any]:
    await load_allocation(session, principal, alloc_id, "allocations.read")
    return list(
        (
            await session.execute(
                select(ssh_grants).where(ssh_grants.c.allocation_id == alloc_id).order_by(ssh_grants.c.created_at)
            )
        ).all()
    )


async def revoke_grant(session: AsyncSession, principal: Principal, alloc_id: uuid.UUID, grant_id: uuid.UUID) -> Any:
    alloc = await load_allocation(session, principal, alloc_id, "allocations.read", lock=True)
    grant = (
        await session.execute(
            select(ssh_grants)
            .where(ssh_grants.c.grant_id == grant_id, ssh_grants.c.allocation_id == alloc_id)
            .with_for_update()
        )
    ).first()
    if grant is None:
        raise NotFound("grant not found", code="ssh_grant_not_found")
    if alloc.owner_user_id != principal.subject and grant.user_id != principal.subject:
        await iam.authorize(session, principal, "allocations.ssh_grant.manage", project_id=alloc.project_id)
    if grant.origin != "user":
        raise Conflict("this key belongs to an app instance; app-runtime revokes it", code="ssh_grant_managed")
    if grant.status == "revoked":
        return grant
    row = await _revoke_grant_row(session, grant, principal.actor)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.ssh_grant.revoke",
        resource_type="ssh_grant",
        resource_id=grant_id,
        tenant_id=alloc.tenant_id,
        project_id=alloc.project_id,
        before={"status": "active"},
        after={"status": "revoked"},
    )
    await sync_keys(session, alloc)
    return row


async def _revoke_grant_row(session: AsyncSession, grant: Any, actor: Actor) -> Any:
    row = (
        await session.execute(
            update(ssh_grants)
            .where(ssh_grants.c.grant_id == grant.grant_id)
            .values(status="revoked", revoked_at=now(), version=ssh_grants.c.version + 1)
            .returning(*ssh_grants.c)
        )
    ).one()
    await add_event(session, ev.SshGrantRevoked.build(data=grant_state(row), source=SERVICE, actor=actor))
    await _timeline(session, grant.allocation_id, "access", "info", f"SSH access revoked ({grant.fingerprint})")
    return row


async def apply_access_grant(session: AsyncSession, grant: Any, *, revoked: bool, actor: Actor) -> None:
    """App-runtime's controller key (AccessGrantState) becomes SSH grants on the listed allocations
    of the same project; allocations no longer listed (or a revoked grant) lose the key."""
    wanted: set[uuid.UUID] = set() if revoked or grant.status == "revoked" else set(grant.allocation_ids)
    existing = {
        r.allocation_id: r
        for r in (
            await session.execute(
                select(ssh_grants).where(ssh_grants.c.access_grant_id == grant.access_grant_id).with_for_update()
            )
        ).all()
    }
    touched: set[uuid.UUID] = set()
    for alloc_id in wanted:
        alloc = (
            await session.execute(
                select(allocations).where(
                    allocations.c.allocation_id == alloc_id, allocations.c.project_id == grant.project_id
                )
            )
        ).first()
        if alloc is None or alloc.status not in SYNCABLE:
            continue
        cur = existing.get(alloc_id)
        if cur is not None and cur.status == "active" and cur.public_key == grant.public_key:
            continue
        if cur is not None:
            row = (
                await session.execute(
                    update(ssh_grants)
                    .where(ssh_grants.c.grant_id == cur.grant_id)
                    .values(
                        status="active",
                        revoked_at=None,
                        public_key=grant.public_key,
                        fingerprint=grant.fingerprint,
                        version=ssh_grants.c.version + 1,
                    )
                    .returning(*ssh_grants.c)
                )
            ).one()
        else:
            row = (
                await session.execute(
                    insert(ssh_grants)
                    .values(
                        grant_id=new_event_id(),
                        allocation_id=alloc_id,
                        tenant_id=alloc.tenant_id,
                        project_id=alloc.project_id,
                        origin="app_access_grant",
                        access_grant_id=grant.access_grant_id,
                        public_key=grant.public_key,
                        fingerprint=grant.fingerprint,
                        status="active",
                        granted_by=f"app-instance:{grant.instance_id}",
                        created_at=now(),
                        version=1,
                    )
                    .returning(*ssh_grants.c)
                )
            ).one()
        await add_event(session, ev.SshGrantCreated.build(data=grant_state(row), source=SERVICE, actor=actor))
        await audit.record(
            session,
            service=SERVICE,
            actor=actor,
            action="allocations.ssh_grant.create",
            resource_type="ssh_grant",
            resource_id=row.grant_id,
            tenant_id=alloc.tenant_id,
            project_id=alloc.project_id,
            reason=f"app access grant {grant.access_grant_id}",
            after={"allocation_id": str(alloc_id), "fingerprint": grant.fingerprint},
        )
        touched.add(alloc_id)
    for alloc_id, cur in existing.items():
        if alloc_id not in wanted and cur.status == "active":
            row = await _revoke_grant_row(session, cur, actor)
            await audit.record(
                session,
                service=SERVICE,
                actor=actor,
                action="allocations.ssh_grant.revoke",
                resource_type="ssh_grant",
                resource_id=row.grant_id,
                tenant_id=row.tenant_id,
                project_id=row.project_id,
                reason=f"app access grant {grant.access_grant_id}",
            )
            touched.add(alloc_id)
    for alloc_id in touched:
        alloc = (await session.execute(select(allocations).where(allocations.c.allocation_id == alloc_id))).one()
        await sync_keys(session, alloc)


async def ssh_key_allowed_for_terminal(session: AsyncSession, principal: Principal, alloc: Any) -> None:
    """The terminal is SSH access: the owner, an active grantee, or a project admin."""
    if alloc.owner_user_id == principal.subject:
        return
    grantee = (
        await session.execute(
            select(ssh_grants.c.grant_id).where(
                ssh_grants.c.allocation_id == alloc.allocation_id,
                ssh_grants.c.user_id == principal.subject,
                ssh_grants.c.status == "active",
            )
        )
    ).first()
    if grantee:
        return
    await iam.authorize(session, principal, "allocations.ssh_grant.manage", project_id=alloc.project_id)


# ----------------------------------------------------------------------------------------------- volumes


async def volume_state(session: AsyncSession, row: Any) -> VolumeState:
    atts = (
        await session.execute(
            select(volume_attachments)
            .where(volume_attachments.c.volume_id == row.volume_id)
            .order_by(volume_attachments.c.attached_at)
        )
    ).all()
    return VolumeState(
        volume_id=row.volume_id,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        name=row.name,
        size_gb=row.size_gb,
        persist=row.persist,
        access_mode=row.access_mode,
        status=row.status,
        attachments=[
            VolumeAttachment(allocation_id=a.allocation_id, mount_path=a.mount_path, attached_at=a.attached_at)
            for a in atts
        ],
        version=row.version,
    )


async def create_volume(
    session: AsyncSession,
    principal: Principal,
    project_id: uuid.UUID,
    *,
    name: str,
    size_gb: int,
    persist: bool,
    access_mode: str,
) -> VolumeState:
    await iam.authorize(session, principal, "allocations.volume.manage", project_id=project_id)
    tenant_id = await iam.project_tenant(session, project_id)
    dup = (
        await session.execute(
            select(volumes.c.volume_id).where(
                volumes.c.project_id == project_id, volumes.c.name == name, volumes.c.status != "deleted"
            )
        )
    ).first()
    if dup:
        raise Conflict(f"the project already has a volume named {name!r}", code="volume_name_taken")
    vid = new_event_id()
    row = (
        await session.execute(
            insert(volumes)
            .values(
                volume_id=vid,
                tenant_id=tenant_id,
                project_id=project_id,
                name=name,
                size_gb=size_gb,
                persist=persist,
                access_mode=access_mode,
                status="available",
            )
            .returning(*volumes.c)
        )
    ).one()
    state = await volume_state(session, row)
    await add_event(session, ev.VolumeCreated.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.volume.create",
        resource_type="volume",
        resource_id=vid,
        tenant_id=tenant_id,
        project_id=project_id,
        after=state.model_dump(mode="json"),
    )
    return state


async def load_volume(
    session: AsyncSession, principal: Principal, volume_id: uuid.UUID, action: str, *, lock: bool = False
) -> Any:
    q = select(volumes).where(volumes.c.volume_id == volume_id)
    row = (await session.execute(q)).first()
    if row is None or row.status == "deleted":
        raise NotFound("volume not found", code="volume_not_found")
    try:
        await iam.authorize(session, principal, action, project_id=row.project_id)
    except NotFound:
        raise NotFound("volume not found", code="volume_not_found") from None
    return (await session.execute(q.with_for_update())).one() if lock else row


async def list_volumes(session: AsyncSession, principal: Principal, project_id: uuid.UUID) -> list[VolumeState]:
    await iam.authorize(session, principal, "allocations.read", project_id=project_id)
    rows = (
        await session.execute(
            select(volumes)
            .where(volumes.c.project_id == project_id, volumes.c.status != "deleted")
            .order_by(volumes.c.created_at)
        )
    ).all()
    return [await volume_state(session, r) for r in rows]


async def _attach(
    session: AsyncSession,
    principal: Principal,
    alloc_id: uuid.UUID,
    project_id: uuid.UUID,
    volume_id: uuid.UUID,
    *,
    emit_task: bool,
    host_id: uuid.UUID | None = None,
) -> VolumeState:
    vol = await load_volume(session, principal, volume_id, "allocations.volume.manage", lock=True)
    if vol.project_id != project_id:
        raise Unprocessable("the volume belongs to another project", code="volume_wrong_project")
    atts = (
        (
            await session.execute(
                select(volume_attachments.c.allocation_id).where(volume_attachments.c.volume_id == volume_id)
            )
        )
        .scalars()
        .all()
    )
    if alloc_id in atts:
        raise Conflict("the volume is already attached to this allocation", code="volume_already_attached")
    if vol.access_mode == "single_writer" and atts:
        raise Conflict(
            f"volume {vol.name!r} is single_writer and already attached to allocation {atts[0]}",
            code="volume_single_writer_in_use",
            attached_to=str(atts[0]),
        )
    mount_path = f"/volumes/{vol.name}"
    await session.execute(
        insert(volume_attachments).values(
            volume_id=volume_id,
            allocation_id=alloc_id,
            mount_path=mount_path,
            exclusive=vol.access_mode == "single_writer",
            attached_at=now(),
        )
    )
    row = (
        await session.execute(
            update(volumes)
            .where(volumes.c.volume_id == volume_id)
            .values(status="attached", version=volumes.c.version + 1)
            .returning(*volumes.c)
        )
    ).one()
    state = await volume_state(session, row)
    await add_event(session, ev.VolumeAttached.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.volume.attach",
        resource_type="volume",
        resource_id=volume_id,
        tenant_id=vol.tenant_id,
        project_id=project_id,
        after={"allocation_id": str(alloc_id), "mount_path": mount_path},
    )
    await _timeline(session, alloc_id, "storage", "info", f"volume {vol.name} attached at {mount_path}")
    if emit_task and host_id is not None:
        await _enqueue(
            session,
            host_id,
            alloc_id,
            "attach_volume",
            {"allocation_id": str(alloc_id), "volume_id": str(volume_id), "mount_path": mount_path},
        )
    return state


async def attach_volume(
    session: AsyncSession, principal: Principal, alloc_id: uuid.UUID, volume_id: uuid.UUID
) -> VolumeState:
    alloc = await load_allocation(session, principal, alloc_id, "allocations.update", lock=True)
    if alloc.status != S.active:
        raise Conflict(
            f"volumes attach to active allocations; this one is {alloc.status}", code="allocation_not_active"
        )
    return await _attach(
        session, principal, alloc_id, alloc.project_id, volume_id, emit_task=True, host_id=alloc.host_id
    )


async def detach_volume(
    session: AsyncSession, principal: Principal, alloc_id: uuid.UUID, volume_id: uuid.UUID
) -> VolumeState:
    alloc = await load_allocation(session, principal, alloc_id, "allocations.update", lock=True)
    if alloc.status != S.active:
        raise Conflict(
            f"volumes detach from active allocations; this one is {alloc.status}", code="allocation_not_active"
        )
    await load_volume(session, principal, volume_id, "allocations.volume.manage", lock=True)
    gone = (
        await session.execute(
            delete(volume_attachments)
            .where(volume_attachments.c.volume_id == volume_id, volume_attachments.c.allocation_id == alloc_id)
            .returning(volume_attachments.c.mount_path)
        )
    ).first()
    if gone is None:
        raise NotFound("the volume is not attached to this allocation", code="volume_not_attached")
    state = await _after_detach(session, volume_id, principal.actor, delete_if_unused=False)
    await _enqueue(
        session,
        alloc.host_id,
        alloc_id,
        "detach_volume",
        {
            "allocation_id": str(alloc_id),
            "volume_id": str(volume_id),
            "mount_path": gone.mount_path,
            "delete_data": False,
        },
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.volume.detach",
        resource_type="volume",
        resource_id=volume_id,
        tenant_id=alloc.tenant_id,
        project_id=alloc.project_id,
        before={"allocation_id": str(alloc_id)},
    )
    await _timeline(session, alloc_id, "storage", "info", f"volume {state.name} detached")
    return state


async def _after_detach(
    session: AsyncSession, volume_id: uuid.UUID, actor: Actor, *, delete_if_unused: bool
) -> VolumeState:
    left = (
        await session.execute(
            select(func.count()).select_from(volume_attachments).where(volume_attachments.c.volume_id == volume_id)
        )
    ).scalar_one()
    vol = (await session.execute(select(volumes).where(volumes.c.volume_id == volume_id))).one()
    status = "attached" if left else ("deleted" if delete_if_unused and not vol.persist else "available")
    row = (
        await session.execute(
            update(volumes)
            .where(volumes.c.volume_id == volume_id)
            .values(status=status, version=volumes.c.version + 1)
            .returning(*volumes.c)
        )
    ).one()
    state = await volume_state(session, row)
    await add_event(session, ev.VolumeDetached.build(data=state, source=SERVICE, actor=actor))
    if status == "deleted":
        await add_event(session, ev.VolumeDeleted.build(data=state, source=SERVICE, actor=actor))
    return state


async def _detach_all(session: AsyncSession, alloc_id: uuid.UUID, *, deleting: bool) -> None:
    ids = (
        (
            await session.execute(
                delete(volume_attachments)
                .where(volume_attachments.c.allocation_id == alloc_id)
                .returning(volume_attachments.c.volume_id)
            )
        )
        .scalars()
        .all()
    )
    for vid in ids:
        await _after_detach(session, vid, SYSTEM, delete_if_unused=deleting)


async def delete_volume(session: AsyncSession, principal: Principal, volume_id: uuid.UUID) -> VolumeState:
    vol = await load_volume(session, principal, volume_id, "allocations.volume.manage", lock=True)
    if vol.status == "attached":
        raise Conflict("detach the volume before deleting it", code="volume_attached")
    row = (
        await session.execute(
            update(volumes)
            .where(volumes.c.volume_id == volume_id)
            .values(status="deleted", version=volumes.c.version + 1)
            .returning(*volumes.c)
        )
    ).one()
    state = await volume_state(session, row)
    await add_event(session, ev.VolumeDeleted.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.volume.delete",
        resource_type="volume",
        resource_id=volume_id,
        tenant_id=vol.tenant_id,
        project_id=vol.project_id,
        before={"status": vol.status},
        after={"status": "deleted"},
    )
    return state


async def volume_summaries(session: AsyncSession, volume_ids: list[uuid.UUID]) -> list[Any]:
    if not volume_ids:
        return []
    return list((await session.execute(select(volumes).where(volumes.c.volume_id.in_(volume_ids)))).all())


# ------------------------------------------------------------------------------------------------ quotas


async def set_quota(session: AsyncSession, principal: Principal, project_id: uuid.UUID, max_gpus: int) -> Any:
    await iam.authorize(session, principal, "allocations.quota.manage", project_id=project_id)
    tenant_id = await iam.project_tenant(session, project_id)
    before = (await session.execute(select(quotas.c.max_gpus).where(quotas.c.project_id == project_id))).first()
    stmt = pg_insert(quotas).values(project_id=project_id, tenant_id=tenant_id, max_gpus=max_gpus)
    row = (
        await session.execute(
            stmt.on_conflict_do_update(
                index_elements=["project_id"], set_={"max_gpus": max_gpus, "version": quotas.c.version + 1}
            ).returning(*quotas.c)
        )
    ).one()
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.quota.set",
        resource_type="quota",
        resource_id=project_id,
        tenant_id=tenant_id,
        project_id=project_id,
        before={"max_gpus": before[0]} if before else None,
        after={"max_gpus": max_gpus},
    )
    return row


async def get_quota(session: AsyncSession, principal: Principal, project_id: uuid.UUID) -> dict[str, Any]:
    await iam.authorize(session, principal, "allocations.read", project_id=project_id)
    row = (await session.execute(select(quotas.c.max_gpus).where(quotas.c.project_id == project_id))).first()
    return {
        "project_id": project_id,
        "max_gpus": row[0] if row else None,
        "gpus_in_use": await _project_gpu_usage(session, project_id),
    }
