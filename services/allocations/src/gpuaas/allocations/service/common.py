"""Helpers every use case shares: the service's actor and clock, the allocation row with its volumes,
versioned updates, checked status transitions, timeline entries and agent task queueing."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import SERVICE, domain
from gpuaas.allocations.models import agent_tasks, allocations, gpu_assignments, timeline, volume_attachments
from gpuaas.contracts import Actor, new_event_id
from gpuaas.contracts.agent import AgentTask, RuntimeImage
from gpuaas.contracts.enums import AllocationStatus
from gpuaas.contracts.events.allocations import (
    AllocationLimits,
    AllocationState,
    PreemptionNotice,
    SshEndpoint,
    WorkloadSpec,
)
from gpuaas.kit import iam, workload_tokens
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import NotFound
from gpuaas.kit.versioning import check_version

SYSTEM = Actor.system(SERVICE)


def now() -> datetime:
    return datetime.now(UTC)


def alloc_state(row: Any) -> AllocationState:
    endpoint = (
        SshEndpoint(host=row.ssh_host, port=row.ssh_port, username=row.ssh_username)
        if row.ssh_host and row.ssh_port and row.status not in (AllocationStatus.released, AllocationStatus.failed)
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
        runtime=row.runtime,
        driver=row.driver,
        limits=row.limits,
        # a launchable app's workload (issue 21), kept in the runtime record; its secret is in no event
        workload=(row.runtime or {}).get("workload"),
        workload_endpoint=(row.runtime or {}).get("workload_endpoint")
        if row.status == AllocationStatus.active
        else None,
        pending_reason=row.pending_reason if row.status == AllocationStatus.queued else None,
        queue_position=row.queue_position if row.status == AllocationStatus.queued else None,
        priority=row.priority,
        max_wait_s=row.max_wait_s,
        preemption=_preemption(row),
        requeued_from=getattr(row, "requeued_from", None),
        pending_resize_gpus=getattr(row, "pending_resize_gpus", None),
        pending_resize_reason=getattr(row, "pending_resize_reason", None),
    )


def _preemption(row: Any) -> PreemptionNotice | None:
    """The preemption notice while one is scheduled (issue 29); kept on the stopped victim as its record."""
    deadline = getattr(row, "preempt_deadline", None)
    if deadline is None or row.preempted_for is None:
        return None
    return PreemptionNotice(
        deadline=deadline,
        reason=row.preemption_reason or "reclaim_guarantee",
        for_allocation_id=row.preempted_for,
        on_preemption="requeue" if row.on_preemption == "requeue" else "release",
        scheduled_at=row.preemption_scheduled_at or deadline,
    )


class _Row(dict):
    """A row with the allocation's attached volume ids added (events carry them)."""

    __getattr__ = dict.__getitem__


async def with_volumes(session: AsyncSession, row: Any) -> Any:
    return (await with_volumes_many(session, [row]))[0]


async def with_volumes_many(session: AsyncSession, rows: list[Any]) -> list[Any]:
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


async def update_allocation(session: AsyncSession, alloc_id: uuid.UUID, **values: Any) -> Any:
    row = (
        await session.execute(
            update(allocations)
            .where(allocations.c.allocation_id == alloc_id)
            .values(version=allocations.c.version + 1, **values)
            .returning(*allocations.c)
        )
    ).one()
    return await with_volumes(session, row)


async def transition(session: AsyncSession, alloc: Any, target: AllocationStatus, **values: Any) -> Any:
    domain.check_transition(alloc.status, target, action=target.value)
    row = await update_allocation(session, alloc.allocation_id, status=target, status_changed_at=now(), **values)
    await record_timeline(
        session,
        alloc.allocation_id,
        "status",
        "info",
        f"{alloc.status} → {target.value}" + (f": {values['failure_reason']}" if values.get("failure_reason") else ""),
    )
    return row


async def insert_rerun(session: AsyncSession, alloc: Any, at: datetime) -> Any:
    """A new `requested` allocation with `alloc`'s spec that names it in `requeued_from` (a preempted victim's
    requeue, a restart whose host is lost), requested `at`; its row. A new id, not the old one back in the queue:
    a meter is one allocation's one usage period."""
    rerun_id = new_event_id()
    await session.execute(
        insert(allocations).values(
            allocation_id=rerun_id,
            tenant_id=alloc.tenant_id,
            project_id=alloc.project_id,
            owner_user_id=alloc.owner_user_id,
            name=alloc.name,
            shape=alloc.shape,
            gpu_model=alloc.gpu_model,
            gpu_count=alloc.gpu_count,
            gpu_indices=[],
            host_class=alloc.host_class,
            status=AllocationStatus.requested,
            status_changed_at=at,
            ssh_username=domain.unix_username(rerun_id),
            requested_at=at,
            priority=alloc.priority,
            max_wait_s=alloc.max_wait_s,
            on_preemption=alloc.on_preemption,
            requested_runtime=alloc.requested_runtime,
            requeued_from=alloc.allocation_id,
        )
    )
    return (await session.execute(select(allocations).where(allocations.c.allocation_id == rerun_id))).one()


async def record_timeline(
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


async def enqueue_task(
    session: AsyncSession, host_id: uuid.UUID, alloc_id: uuid.UUID | None, task: AgentTask
) -> uuid.UUID:
    """Queue `task` for the host's agent (its row holds the task as JSON, `kind` included) and wake a long-poll."""
    task_id = new_event_id()
    await session.execute(
        insert(agent_tasks).values(
            task_id=task_id,
            host_id=host_id,
            allocation_id=alloc_id,
            kind=task.kind,
            payload=task.model_dump(mode="json"),
            status="pending",
        )
    )
    if alloc_id is not None:
        await record_timeline(
            session, alloc_id, task.kind, "started", f"{task.kind} queued for the host agent", task_id=task_id
        )
    await session.execute(text("SELECT pg_notify('allocations_tasks', :h)"), {"h": str(host_id)})
    return task_id


ADMISSION_CHANNEL = "allocations_admission"  # NOTIFY: capacity or demand changed; every replica's runner wakes


async def poke_admission(session: AsyncSession, gpu_model: str = "") -> None:
    """Wake the admission runners (this replica's and the others') once this transaction commits."""
    await session.execute(text("SELECT pg_notify(:c, :m)"), {"c": ADMISSION_CHANNEL, "m": gpu_model})


async def free_capacity(session: AsyncSession, alloc_id: uuid.UUID) -> None:
    freed = await session.execute(
        delete(gpu_assignments).where(gpu_assignments.c.allocation_id == alloc_id).returning(gpu_assignments.c.host_id)
    )
    if freed.first() is not None:  # GPUs came free: a waiting request may fit now
        await poke_admission(session)


async def load_allocation(
    session: AsyncSession,
    principal: Principal,
    alloc_id: uuid.UUID,
    action: str,
    *,
    lock: bool = False,
    expected_version: int | None = None,
) -> Any:
    """The allocation, if the principal may `action` it (else 404). With `lock` the row stays locked for
    the rest of the transaction, and `expected_version` (the request's If-Match) is checked under that
    lock: 412 `version_mismatch` if the allocation moved on, so of two writers of one version only one wins."""
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
    check_version(row.version, expected_version)
    return await with_volumes(session, row)


def workload_payload(runtime: dict[str, Any] | None) -> tuple[WorkloadSpec | None, str | None]:
    """The workload part of a provision/restart/resize task: the spec and its secret (never in an event)."""
    spec = (runtime or {}).get("workload")
    if not spec:
        return None, None
    workload = WorkloadSpec.model_validate(spec)
    return workload, workload_tokens.derive(workload_tokens.key_from_env(), str(workload.instance_id))


def runtime_image(runtime: dict[str, Any] | None) -> RuntimeImage | None:
    """The image a container allocation runs (pinned by digest), from its runtime record."""
    return RuntimeImage(image=runtime["image"], digest=runtime["digest"]) if runtime else None


def container_limits(limits: dict[str, Any] | None) -> AllocationLimits | None:
    return AllocationLimits.model_validate(limits) if limits else None
