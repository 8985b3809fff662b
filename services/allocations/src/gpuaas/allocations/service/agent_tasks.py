"""The agents' task queue: lease, progress, completion, and each task kind's outcome applied once
to its allocation."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

from pydantic import ValidationError
from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import SERVICE
from gpuaas.allocations.metrics import activated
from gpuaas.allocations.models import agent_tasks, allocations, gpu_assignments
from gpuaas.allocations.service.agents import host_by_token
from gpuaas.allocations.service.common import (
    SYSTEM,
    alloc_state,
    free_capacity,
    now,
    poke_admission,
    record_timeline,
    transition,
)
from gpuaas.allocations.service.hosts import load_host
from gpuaas.allocations.service.volumes import detach_all
from gpuaas.contracts.agent import (
    RESULT_TYPES,
    AttachVolumeResult,
    DetachVolumeResult,
    NotifyPreemptionResult,
    ProvisionResult,
    ReleaseResult,
    ResizeResult,
    ResizeTask,
    RestartResult,
    SyncSshKeysResult,
    TaskCompletion,
    TaskLease,
    TaskOutcome,
    TaskProgress,
    WorkloadReport,
    complete_table,
    parse_result,
    parse_task,
)
from gpuaas.contracts.enums import AllocationStatus
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.kit.errors import NotFound, Unprocessable
from gpuaas.kit.outbox import add_event

R = TypeVar("R", bound=TaskOutcome)


async def claim_tasks(session: AsyncSession, host_id: uuid.UUID, *, lease_s: float, limit: int = 20) -> list[TaskLease]:
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
    leases = []
    for row in sorted(rows.all(), key=lambda r: r.seq):
        try:
            leases.append(_lease(row))
        except ValueError as exc:  # queued by a newer version (a kind or shape this one cannot read)
            await _fail_unreadable(session, row, exc)
    return leases


def _lease(row: Any) -> TaskLease:
    """A leased row as the agent receives it; a row queued before tasks carried `kind` gets the row's."""
    return TaskLease(
        task_id=row.task_id,
        kind=row.kind,
        allocation_id=row.allocation_id,
        payload=parse_task(row.kind, row.payload),
        attempts=row.attempts,
        lease_expires_at=row.lease_expires_at,
    )


def _why(exc: ValueError) -> str:
    return str(exc.errors()[0]["msg"]) if isinstance(exc, ValidationError) else str(exc)


async def _fail_unreadable(session: AsyncSession, row: Any, exc: ValueError) -> None:
    """A task this version of the service cannot read is never handed out: failed with the reason, so that it
    does not block the host's queue (after a rollback to an older service, say)."""
    reason = f"this control plane cannot read a {row.kind!r} task: {_why(exc)}"
    await session.execute(
        update(agent_tasks)
        .where(agent_tasks.c.task_id == row.task_id)
        .values(status="failed", error=reason, finished_at=now(), lease_token=None, lease_expires_at=None)
    )
    if row.allocation_id is not None:
        await record_timeline(session, row.allocation_id, row.kind, "failed", reason, task_id=row.task_id)


async def requeue_expired_tasks(session: AsyncSession) -> int:
    res = await session.execute(
        update(agent_tasks)
        .where(agent_tasks.c.status == "leased", agent_tasks.c.lease_expires_at < now())
        .values(status="pending", lease_token=None, lease_expires_at=None)
        .returning(agent_tasks.c.task_id)
    )
    return len(res.all())


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
    step: TaskProgress,
    *,
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
        await record_timeline(
            session,
            task.allocation_id,
            f"{task.kind}.{step.phase}",
            step.status,
            step.message,
            task_id=task_id,
            started_at=step.started_at,
            finished_at=step.finished_at,
        )


async def complete_task(session: AsyncSession, token: str | None, task_id: uuid.UUID, report: TaskCompletion) -> bool:
    """Apply a task's outcome once; a repeated report (agent retry, journal replay) is a no-op. The result is
    read as the leased task's kind's `AgentResult` (422 `invalid_task_result` when it is not one)."""
    host = await host_by_token(session, token)
    task = await _task_for_host(session, host.host_id, task_id)
    if task.status in ("succeeded", "failed"):
        return False
    try:
        result = parse_result(task.kind, report.result)
    except ValueError as exc:  # pydantic's ValidationError or KindMismatch
        raise Unprocessable(
            f"the result is not a {task.kind} result: {_why(exc)}", code="invalid_task_result"
        ) from None
    await session.execute(
        update(agent_tasks)
        .where(agent_tasks.c.task_id == task_id)
        .values(
            status="succeeded" if report.ok else "failed",
            result=result.model_dump(mode="json", exclude_unset=True),  # what the agent reported and we read
            error=None if report.ok else report.message,
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
    await record_timeline(
        session,
        alloc.allocation_id,
        task.kind,
        "succeeded" if report.ok else "failed",
        report.message or ("done" if report.ok else "failed"),
        task_id=task_id,
        started_at=task.created_at,
    )
    await _OUTCOMES[type(result)](session, Completed(alloc, task, report.ok, report.message, result))
    return True


@dataclass(frozen=True)
class Completed(Generic[R]):
    """A reported outcome with what it applies to: the allocation (locked) and the task row."""

    alloc: Any
    task: Any
    ok: bool
    message: str
    result: R


def reported_network(
    result: ProvisionResult | RestartResult | ResizeResult, keep: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The allocation's project-network address as its agent reports it (container driver), as validated by
    the contract (`NetworkInfo`: a name, an IP address or None, a hostname or None). Absent from the result
    (an older agent): `keep`. The scope is the service's: `project` with an overlay assignment (kept from
    `keep`: service/overlay.py), else `host`."""
    overlay = {"overlay": keep["overlay"]} if keep and keep.get("overlay") else {}
    if "network" not in result.model_fields_set:
        return keep
    if result.network is None:  # malformed: not shown; an overlay address is the service's own and stays
        return keep if overlay else None
    return {**result.network.model_dump(mode="json"), "scope": "project" if overlay else "host", **overlay}


def workload_endpoint(
    runtime: dict[str, Any] | None, host: Any, reported: WorkloadReport | None
) -> dict[str, Any] | None:
    """The runtime record with the workload's endpoint: the ENROLLED host address and the reported port (the
    contract bounds it to 1-65535; a malformed report arrives as None)."""
    if not (runtime or {}).get("workload") or reported is None:
        return None
    endpoint = {"host": host.ssh_host, "port": reported.host_port, "healthy": reported.healthy}
    return {**(runtime or {}), "workload_endpoint": endpoint}


async def _on_provision(session: AsyncSession, c: Completed[ProvisionResult]) -> None:
    alloc, task, result = c.alloc, c.task, c.result
    if alloc.status != AllocationStatus.provisioning:
        return
    if c.ok:
        # The endpoint is the enrolled host's (pinned), never what the completion reports: a holder of
        # the node token must not be able to point users or the browser terminal elsewhere.
        host = await load_host(session, alloc.host_id)
        reported = (result.ssh_host, result.ssh_port)
        if reported != (None, None) and reported != (host.ssh_host, host.ssh_port):
            await record_timeline(
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
        runtime = workload_endpoint(alloc.runtime, host, result.workload)
        row = await transition(
            session,
            alloc,
            AllocationStatus.active,
            activated_at=t,
            ssh_host=host.ssh_host,
            ssh_port=host.ssh_port,
            failure_reason=None,
            network=reported_network(result, alloc.network),
            **({"runtime": runtime} if runtime else {}),
        )
        activated(session, alloc.requested_at, t)
        await add_event(
            session, allocation_events.AllocationActivated.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM)
        )
    else:
        await free_capacity(session, alloc.allocation_id)
        await detach_all(session, alloc.allocation_id, deleting=False)
        row = await transition(
            session, alloc, AllocationStatus.failed, failure_reason=c.message or "provisioning failed"
        )
        await add_event(
            session, allocation_events.AllocationFailed.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM)
        )


async def _on_restart(session: AsyncSession, c: Completed[RestartResult]) -> None:
    alloc = c.alloc
    if alloc.status != AllocationStatus.restarting:
        return
    if c.ok:
        network = reported_network(c.result, alloc.network)
        row = await transition(session, alloc, AllocationStatus.active, failure_reason=None, network=network)
        await add_event(
            session, allocation_events.AllocationRestarted.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM)
        )
    else:
        row = await transition(session, alloc, AllocationStatus.active, failure_reason=f"restart failed: {c.message}")
        await add_event(
            session,
            allocation_events.AllocationRestartFailed.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM),
        )


async def _on_resize(session: AsyncSession, c: Completed[ResizeResult]) -> None:
    alloc = c.alloc
    if alloc.status != AllocationStatus.resizing:
        return
    target = list(alloc.target_gpu_indices or [])
    keep = target if c.ok else list(alloc.gpu_indices)
    shrunk = await session.execute(
        delete(gpu_assignments)
        .where(gpu_assignments.c.allocation_id == alloc.allocation_id, gpu_assignments.c.gpu_index.notin_(keep))
        .returning(gpu_assignments.c.gpu_index)
    )
    if shrunk.first() is not None:  # GPUs came free: a waiting request may fit now
        await poke_admission(session)
    if c.ok:
        task = parse_task(c.task.kind, c.task.payload)
        limits = task.limits if isinstance(task, ResizeTask) else None
        row = await transition(
            session,
            alloc,
            AllocationStatus.active,
            gpu_count=len(target),
            gpu_indices=target,
            target_gpu_count=None,
            target_gpu_indices=None,
            failure_reason=None,
            limits=(limits.model_dump(mode="json") if limits else None) if alloc.runtime else alloc.limits,
            network=reported_network(c.result, alloc.network),  # a recreated container may have a new address
        )
        await add_event(
            session, allocation_events.AllocationResized.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM)
        )
    else:
        row = await transition(
            session,
            alloc,
            AllocationStatus.active,
            target_gpu_count=None,
            target_gpu_indices=None,
            failure_reason=f"resize failed: {c.message}",
        )
        await add_event(
            session, allocation_events.AllocationResizeFailed.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM)
        )


async def _on_release(session: AsyncSession, c: Completed[ReleaseResult]) -> None:
    alloc = c.alloc
    if alloc.status != AllocationStatus.releasing:
        return
    evidence = c.result.evidence
    stored = evidence.model_dump(mode="json", exclude_unset=True) if evidence is not None else None
    if evidence is not None:
        outcome = "succeeded" if c.ok else "failed"
        await record_timeline(session, alloc.allocation_id, "release.evidence", outcome, evidence.summary())
    if c.ok:
        await free_capacity(session, alloc.allocation_id)
        await detach_all(session, alloc.allocation_id, deleting=True)
        row = await transition(
            session,
            alloc,
            AllocationStatus.released,
            released_at=now(),
            failure_reason=None,
            target_gpu_count=None,
            target_gpu_indices=None,
            release_evidence=stored,
        )
        await add_event(
            session, allocation_events.AllocationReleased.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM)
        )
    else:
        row = await transition(
            session,
            alloc,
            AllocationStatus.release_failed,
            failure_reason=c.message or "release failed",
            release_evidence=stored,
        )
        await add_event(
            session,
            allocation_events.AllocationReleaseFailed.build(data=alloc_state(row), source=SERVICE, actor=SYSTEM),
        )


async def _on_notify_preemption(session: AsyncSession, c: Completed[NotifyPreemptionResult]) -> None:
    """The preemption notice inside the allocation: what the agent delivered (the stop happens at the deadline
    whatever the notice's outcome)."""
    if c.ok:
        where = "/run/gpuaas/preemption written" if c.result.file_written else "no notice file written"
        note = f"notice delivered: {where}; {c.result.sessions_notified} SSH session(s) told"
        await record_timeline(session, c.alloc.allocation_id, "preemption.notice", "info", note)


async def _timeline_only(session: AsyncSession, c: Completed[TaskOutcome]) -> None:
    """Key sync and volume changes: the task's timeline entry (written above) is the whole outcome."""


# The outcome of each result type; a result type without an entry fails at import. The values take
# `Completed[Any]`: each handler's own signature names its result type, the key pairs them.
_OUTCOMES: dict[type[TaskOutcome], Callable[[AsyncSession, Completed[Any]], Awaitable[None]]] = {
    ProvisionResult: _on_provision,
    RestartResult: _on_restart,
    ResizeResult: _on_resize,
    ReleaseResult: _on_release,
    SyncSshKeysResult: _timeline_only,
    AttachVolumeResult: _timeline_only,
    DetachVolumeResult: _timeline_only,
    NotifyPreemptionResult: _on_notify_preemption,
}
complete_table(_OUTCOMES, RESULT_TYPES, "allocations' agent task outcomes")
