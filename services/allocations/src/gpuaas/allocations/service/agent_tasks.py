"""The agents' task queue: lease, progress, completion, and each task kind's outcome applied once
to its allocation."""

from __future__ import annotations

import ipaddress
import re
import uuid
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import SERVICE
from gpuaas.allocations.metrics import activated
from gpuaas.allocations.models import agent_tasks, allocations, gpu_assignments
from gpuaas.allocations.service.agents import host_by_token
from gpuaas.allocations.service.common import SYSTEM, _free_capacity, _timeline, _transition, alloc_state, now
from gpuaas.allocations.service.hosts import load_host
from gpuaas.allocations.service.launch import workload_endpoint
from gpuaas.allocations.service.volumes import _detach_all
from gpuaas.allocations.views import Task
from gpuaas.contracts.enums import AllocationStatus
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.kit.errors import NotFound
from gpuaas.kit.outbox import add_event


async def claim_tasks(session: AsyncSession, host_id: uuid.UUID, *, lease_s: float, limit: int = 20) -> list[Task]:
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
    return [Task.model_validate(r, from_attributes=True) for r in sorted(rows.all(), key=lambda r: r.seq)]


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
    token: str | None,
    task_id: uuid.UUID,
    *,
    phase: str,
    status: str,
    message: str,
    started_at: datetime | None,
    finished_at: datetime | None,
    lease_s: float,
) -> None:
    host = await host_by_token(session, token)
    task = await _task_for_host(session, host.host_id, task_id)
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
    session: AsyncSession, token: str | None, task_id: uuid.UUID, *, ok: bool, message: str, result: dict[str, Any]
) -> bool:
    """Apply a task's outcome once; a repeated report (agent retry, journal replay) is a no-op."""
    host = await host_by_token(session, token)
    task = await _task_for_host(session, host.host_id, task_id)
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


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def reported_network(result: dict[str, Any], keep: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The allocation's project-network address as its agent reports it (container driver), checked for shape:
    a name, an IP address, a hostname. Absent from the result (an older agent): `keep`."""
    if "network" not in result:
        return keep
    net = result["network"]
    if not isinstance(net, dict) or not _NAME.match(str(net.get("name") or "")):
        return None
    try:
        address = str(ipaddress.ip_address(str(net.get("address")))) if net.get("address") else None
    except ValueError:
        address = None
    hostname = str(net.get("hostname") or "")
    return {
        "name": str(net["name"]),
        "address": address,
        "hostname": hostname if _NAME.match(hostname) else None,
        "scope": "host",
    }


async def _on_provision(
    session: AsyncSession, alloc: Any, task: Any, ok: bool, message: str, result: dict[str, Any]
) -> None:
    if alloc.status != AllocationStatus.provisioning:
        return
    if ok:
        # The endpoint is the enrolled host's (pinned), never what the completion reports: a holder of
        # the node token must not be able to point users or the browser terminal elsewhere.
        host = await load_host(session, alloc.host_id)
        reported = (result.get("ssh_host"), result.get("ssh_port"))
        if reported != (None, None) and reported != (host.ssh_host, host.ssh_port):
            await _timeline(
                session,
                alloc.allocation_id,
                "provision",
                "info",
                f"the agent reported SSH endpoint {reported[0]}:{reported[1]}; "
                f"the host's enrolled endpoint {host.ssh_host}:{host.ssh_port} is used",
                task_id=task.task_id,
            )
        t = now()
        # A launchable workload (issue 21): its endpoint is the enrolled host's address + the published port.
        runtime = workload_endpoint(alloc.runtime, host, result)
        row = await _transition(
            session,
            alloc,
            AllocationStatus.active,
            activated_at=t,
            ssh_host=host.ssh_host,
            ssh_port=host.ssh_port,
            failure_reason=None,
            network=reported_network(result),
            **({"runtime": runtime} if runtime else {}),
        )
        activated(session, alloc.requested_at, t)
        await add_event(
            session, allocation_events.AllocationActivated.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM)
        )
    else:
        await _free_capacity(session, alloc.allocation_id)
        await _detach_all(session, alloc.allocation_id, deleting=False)
        row = await _transition(
            session, alloc, AllocationStatus.failed, failure_reason=message or "provisioning failed"
        )
        await add_event(
            session, allocation_events.AllocationFailed.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM)
        )


async def _on_restart(
    session: AsyncSession, alloc: Any, task: Any, ok: bool, message: str, result: dict[str, Any]
) -> None:
    if alloc.status != AllocationStatus.restarting:
        return
    if ok:
        network = reported_network(result, alloc.network)
        row = await _transition(session, alloc, AllocationStatus.active, failure_reason=None, network=network)
        await add_event(
            session, allocation_events.AllocationRestarted.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM)
        )
    else:
        row = await _transition(session, alloc, AllocationStatus.active, failure_reason=f"restart failed: {message}")
        await add_event(
            session,
            allocation_events.AllocationRestartFailed.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM),
        )


async def _on_resize(
    session: AsyncSession, alloc: Any, task: Any, ok: bool, message: str, result: dict[str, Any]
) -> None:
    if alloc.status != AllocationStatus.resizing:
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
            AllocationStatus.active,
            gpu_count=len(target),
            gpu_indices=target,
            target_gpu_count=None,
            target_gpu_indices=None,
            failure_reason=None,
            limits=task.payload.get("limits") if alloc.runtime else alloc.limits,
            network=reported_network(result, alloc.network),  # a recreated container may have a new address
        )
        await add_event(
            session, allocation_events.AllocationResized.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM)
        )
    else:
        row = await _transition(
            session,
            alloc,
            AllocationStatus.active,
            target_gpu_count=None,
            target_gpu_indices=None,
            failure_reason=f"resize failed: {message}",
        )
        await add_event(
            session, allocation_events.AllocationResizeFailed.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM)
        )


async def _on_release(
    session: AsyncSession, alloc: Any, task: Any, ok: bool, message: str, result: dict[str, Any]
) -> None:
    if alloc.status != AllocationStatus.releasing:
        return
    evidence = result.get("evidence") if isinstance(result.get("evidence"), dict) else None
    if evidence is not None:
        outcome = "succeeded" if ok else "failed"
        await _timeline(session, alloc.allocation_id, "release.evidence", outcome, _evidence_summary(evidence))
    if ok:
        await _free_capacity(session, alloc.allocation_id)
        await _detach_all(session, alloc.allocation_id, deleting=True)
        row = await _transition(
            session,
            alloc,
            AllocationStatus.released,
            released_at=now(),
            failure_reason=None,
            target_gpu_count=None,
            target_gpu_indices=None,
            release_evidence=evidence,
        )
        await add_event(
            session, allocation_events.AllocationReleased.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM)
        )
    else:
        row = await _transition(
            session,
            alloc,
            AllocationStatus.release_failed,
            failure_reason=message or "release failed",
            release_evidence=evidence,
        )
        await add_event(
            session,
            allocation_events.AllocationReleaseFailed.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM),
        )


def _evidence_summary(evidence: dict[str, Any]) -> str:
    """One line for the timeline: each boolean check the agent made and its outcome, then what it lists."""
    flags = [f"{k}={'yes' if v else 'NO'}" for k, v in evidence.items() if isinstance(v, bool)]
    checked = evidence.get("checked")
    listed = f"; checked: {', '.join(map(str, checked))}" if isinstance(checked, list) and checked else ""
    return "release evidence: " + (", ".join(flags) or "none reported") + listed


_OUTCOMES = {"provision": _on_provision, "restart": _on_restart, "resize": _on_resize, "release": _on_release}
