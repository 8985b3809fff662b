"""The allocation lifecycle: create (placement, quota, volumes, provision task), list, restart (in place, or
re-run elsewhere when its host is lost), release (with app-runtime's clearance) and retry release. Resizing is
`resizes.py`."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import SERVICE, domain
from gpuaas.allocations.models import allocations, app_members, hosts, volume_attachments, volumes
from gpuaas.allocations.service.access import authorized_keys
from gpuaas.allocations.service.common import (
    alloc_state,
    container_limits,
    enqueue_task,
    insert_rerun,
    load_allocation,
    now,
    record_timeline,
    runtime_image,
    transition,
    update_allocation,
    with_volumes,
    with_volumes_many,
    workload_payload,
)
from gpuaas.allocations.service.host_classes import runtime_and_limits
from gpuaas.allocations.service.overlay import overlay_for
from gpuaas.allocations.service.placement import check_model_offered, place
from gpuaas.allocations.service.quotas import check_quota
from gpuaas.allocations.service.runtimes import resolve_runtime
from gpuaas.allocations.service.volumes import attach_to_allocation, volume_mounts, volume_summaries
from gpuaas.allocations.service.waiting import (
    cancel_queued,
    enqueue,
    limits_wait,
    others_waiting,
)
from gpuaas.allocations.views import Allocation, AllocationChange, AllocationNetwork, VolumeRef
from gpuaas.contracts import Actor, Event, new_event_id
from gpuaas.contracts.agent import ProvisionTask, ReleaseTask, ReleaseVolume, RestartTask
from gpuaas.contracts.enums import AllocationStatus, CapacityShape, PendingReason
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.contracts.events.allocations import HostStatus
from gpuaas.kit import audit, iam, paging
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, Unprocessable
from gpuaas.kit.outbox import add_event, add_events
from gpuaas.kit.paging import PageRequest

W = TypeVar("W", ProvisionTask, RestartTask)

LIVE_MEMBER = ("pending", "starting", "active", "draining", "stopping")
# A host an allocation cannot restart on: a restart re-runs it elsewhere (issue 29).
LOST_HOST = (HostStatus.unreachable, HostStatus.decommissioned)


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
    runtime: str | None = None,
    queue: bool = True,
    priority: int = 0,
    max_wait_s: int | None = None,
    on_preemption: str = "release",
) -> AllocationChange[Allocation]:
    """`runtime` (slug, slug@version or digest of an offered runtime) is checked before placement (422
    `runtime_unavailable`) and then places on container hosts only; without it the host class's default
    (else the platform's) applies on a container host and a process host runs no runtime image.

    `queue` (issue 29): a request that cannot be placed now (no capacity, or its project at its quota) waits
    `queued` with its reason instead of 409, and so does one of a pool where others already wait for GPUs
    (they go first: the admission runner decides). `queue=False` keeps the immediate 409."""
    await iam.authorize(session, principal, "allocations.create", project_id=project_id)
    tenant_id = await iam.project_tenant(session, project_id)
    assert tenant_id is not None
    if shape is CapacityShape.gpu_slice and not gpu_count:
        raise Unprocessable("gpu_count is required for a gpu_slice", code="gpu_count_required")
    if runtime is not None:
        await resolve_runtime(session, runtime, tenant_id)
    waits_for = await limits_wait(session, tenant_id, project_id, gpu_model, gpu_count or 1, queue=queue)
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
            status=AllocationStatus.requested,
            status_changed_at=t,
            ssh_username=domain.unix_username(alloc_id),
            requested_at=t,
            priority=priority,
            max_wait_s=max_wait_s,
            on_preemption=on_preemption,
            requested_runtime=runtime,
        )
    )
    placed: tuple[Any, list[int]] | None = None
    if waits_for is None and queue and await others_waiting(session, gpu_model, alloc_id):
        waits_for = PendingReason.no_capacity
    if waits_for is not None:  # not placed now: still a 422 for a model no host offers
        await check_model_offered(session, gpu_model)
    if waits_for is None:
        try:
            placed = await place(
                session,
                shape=shape,
                model=gpu_model,
                count=gpu_count,
                host_class=host_class,
                alloc_id=alloc_id,
                tenant_id=tenant_id,
                container_only=runtime is not None,
                count_refusal=not queue,
            )
        except Conflict as exc:
            if not queue or exc.code != "insufficient_capacity":
                raise
            waits_for = PendingReason.no_capacity
    if placed is not None and len(placed[1]) != (gpu_count or 1):  # a whole host: its GPU count is known only now
        await session.execute(
            update(allocations).where(allocations.c.allocation_id == alloc_id).values(gpu_count=len(placed[1]))
        )
        await check_quota(session, project_id, 0)
    requested = await with_volumes(
        session, (await session.execute(select(allocations).where(allocations.c.allocation_id == alloc_id))).one()
    )
    events: list[Event] = [
        allocation_events.AllocationRequested.build(data=alloc_state(requested), source=SERVICE, actor=principal.actor)
    ]
    await record_timeline(session, alloc_id, "status", "info", "requested")
    for vid in volume_ids:
        await attach_to_allocation(session, principal, alloc_id, project_id, vid, emit_task=False)
    if placed is None:
        assert waits_for is not None
        row = await enqueue(session, requested, waits_for, events=events, actor=principal.actor)
    else:
        row = await admit(session, requested, *placed, events=events, actor=principal.actor)
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
    return await changed(session, row)


async def admit(
    session: AsyncSession, requested: Any, host: Any, picked: list[int], *, events: list[Event], actor: Actor
) -> Any:
    """A request placed on `host` (GPUs `picked` reserved): its runtime and limits resolved for that host,
    then provisioning (create, and the admission runner for a queued one)."""
    runtime_ref, limits = await runtime_and_limits(
        session, host, requested=requested.requested_runtime, tenant_id=requested.tenant_id, gpu_count=len(picked)
    )
    note = (f"; runtime {runtime_ref.slug} {runtime_ref.version} ({runtime_ref.digest})" if runtime_ref else "") + (
        f"; limits {limits['cpus']} CPUs, {limits['memory_mb']} MB, {limits['pids']} pids" if limits else ""
    )
    return await start_provisioning(
        session,
        requested,
        host,
        picked,
        runtime=runtime_ref.model_dump() if runtime_ref else None,
        limits=limits,
        note=note,
        events=events,
        actor=actor,
    )


async def start_provisioning(
    session: AsyncSession,
    requested: Any,
    host: Any,
    picked: list[int],
    *,
    runtime: dict[str, Any] | None,
    limits: dict[str, Any] | None,
    note: str,
    events: list[Event],
    actor: Actor,
) -> Any:
    """A placed allocation: provisioning on `host` with GPUs `picked`, the placement on its timeline, `events`
    plus allocation.provisioning in the outbox, and the provision task queued for the host's agent."""
    row = await transition(
        session,
        requested,
        AllocationStatus.provisioning,
        host_id=host.host_id,
        gpu_indices=picked,
        gpu_count=len(picked),
        driver=host.driver,
        runtime=runtime,
        limits=limits,
        pending_reason=None,
        queue_position=None,
    )
    await record_timeline(
        session,
        row.allocation_id,
        "placement",
        "succeeded",
        f"placed on {host.name}: GPUs {','.join(map(str, picked))}{note}",
    )
    events.append(allocation_events.AllocationProvisioning.build(data=alloc_state(row), source=SERVICE, actor=actor))
    await add_events(session, events)
    await enqueue_task(
        session, host.host_id, row.allocation_id, await _workspace_task(ProvisionTask, session, row, picked)
    )
    return row


async def _workspace_task(task_type: type[W], session: AsyncSession, row: Any, gpu_indices: list[int]) -> W:
    """What the agent (re)builds an allocation's workspace from: account, GPUs, keys, volumes, and on a
    container host the runtime image (pinned by digest), the container's limits and a launchable workload."""
    workload, workload_token = workload_payload(row.runtime)
    return task_type(
        allocation_id=row.allocation_id,
        username=row.ssh_username,
        gpu_indices=gpu_indices,
        authorized_keys=await authorized_keys(session, row),
        volumes=await volume_mounts(session, row.allocation_id),
        project_id=row.project_id,  # the container driver's project network
        tenant_id=row.tenant_id,
        runtime=runtime_image(row.runtime),
        limits=container_limits(row.limits),
        workload=workload,
        workload_token=workload_token,
        overlay=await overlay_for(session, row),  # the project's segment across hosts, the allocation's address
    )


async def list_allocations(
    session: AsyncSession,
    principal: Principal,
    *,
    project_id: uuid.UUID | None,
    include_released: bool,
    page: PageRequest = PageRequest(limit=500),
) -> tuple[list[Allocation], str | None]:
    """One page of allocations, newest first (keyset on requested_at, allocation_id), and the next
    page's cursor (None on the last page)."""
    q = select(allocations)
    if project_id is not None:
        await iam.authorize(session, principal, "allocations.read", project_id=project_id)
        q = q.where(allocations.c.project_id == project_id)
    else:
        visible = await iam.visible_project_ids(session, principal)
        if visible is not None:
            q = q.where(allocations.c.project_id.in_(visible or [uuid.UUID(int=0)]))
    if not include_released:
        q = q.where(allocations.c.status.notin_([AllocationStatus.released, AllocationStatus.failed]))
    q = paging.keyset(q, [allocations.c.requested_at, allocations.c.allocation_id], page)
    rows, next_cursor = paging.split(
        (await session.execute(q)).all(), page, lambda r: (r.requested_at, r.allocation_id)
    )
    return await allocation_views(session, await with_volumes_many(session, rows)), next_cursor


async def get_allocation(session: AsyncSession, principal: Principal, alloc_id: uuid.UUID) -> Allocation:
    return (await allocation_views(session, [await load_allocation(session, principal, alloc_id, "allocations.read")]))[
        0
    ]


async def allocation_views(session: AsyncSession, rows: list[Any]) -> list[Allocation]:
    """The API shape of allocations; their volumes are read in one query for the whole list."""
    wanted = list({v for row in rows for v in row.volume_ids})
    by_id = {v.volume_id: v for v in await volume_summaries(session, wanted)}
    return [_view(row, [by_id[v] for v in row.volume_ids if v in by_id]) for row in rows]


def _view(row: Any, vols: list[Any]) -> Allocation:
    # model_construct: the state is validated once by alloc_state and the added fields are built here
    # (validating the dumped state again cost as much as building it; lists render hundreds of rows).
    return Allocation.model_construct(
        **{
            **dict(alloc_state(row)),
            "estimated_start_at": row.estimated_start_at if row.status == AllocationStatus.queued else None,
            "pending_resize_since": getattr(row, "pending_resize_since", None),
            "volumes": [
                VolumeRef(
                    volume_id=v.volume_id,
                    name=v.name,
                    persist=v.persist,
                    access_mode=v.access_mode,
                    after_release=domain.after_release(v.persist),
                )
                for v in vols
            ],
            "after_release": domain.allocation_after_release([(v.name, v.persist) for v in vols]),
            "awaiting_release_clearance": row.awaiting_clearance_since is not None,
            "release_evidence": row.release_evidence,
            "network": AllocationNetwork(**row.network) if row.network else None,
        }
    )


async def changed(session: AsyncSession, row: Any) -> AllocationChange[Allocation]:
    """The allocation after a change: its view, new version and host."""
    view = (await allocation_views(session, [row]))[0]
    return AllocationChange(body=view, version=row.version, host_id=row.host_id)


async def restart_allocation(
    session: AsyncSession, principal: Principal, alloc_id: uuid.UUID, *, expected_version: int | None = None
) -> AllocationChange[Allocation]:
    """Restart in place; an allocation whose host is lost (unreachable or decommissioned) cannot restart there,
    so it is re-run elsewhere (`_restart_elsewhere`) and the answer is the re-run."""
    alloc = await load_allocation(
        session, principal, alloc_id, "allocations.update", lock=True, expected_version=expected_version
    )
    if alloc.host_id is not None:
        host = (
            await session.execute(select(hosts.c.name, hosts.c.status).where(hosts.c.host_id == alloc.host_id))
        ).one()
        if host.status in LOST_HOST:
            domain.check_transition(alloc.status, AllocationStatus.restarting, action="restart")
            return await _restart_elsewhere(session, principal, alloc, host)
    before = alloc_state(alloc)
    row = await transition(session, alloc, AllocationStatus.restarting, failure_reason=None)
    await add_event(
        session,
        allocation_events.AllocationRestarting.build(data=alloc_state(row), source=SERVICE, actor=principal.actor),
    )
    await enqueue_task(
        session, row.host_id, alloc_id, await _workspace_task(RestartTask, session, row, list(row.gpu_indices))
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
    return await changed(session, row)


async def _restart_elsewhere(
    session: AsyncSession, principal: Principal, alloc: Any, host: Any
) -> AllocationChange[Allocation]:
    """Restart of an allocation whose host is lost: a NEW allocation with its spec and volumes (`requeued_from`
    names it) placed on another host now, else `queued` (no_capacity, or over_limit while the lost allocation
    still counts against its quota) and admitted like a create. The lost allocation is released (billing stops
    now; its release task runs if the host's agent comes back), in this same transaction. A new id for the
    reason a preempted victim's requeue gets one: a meter is one allocation's one usage period."""
    rerun = await insert_rerun(session, alloc, now())
    rerun_id = rerun.allocation_id
    # Its volumes go with it (before the release is queued, so the lost host's release deletes no data).
    await session.execute(
        update(volume_attachments)
        .where(volume_attachments.c.allocation_id == alloc.allocation_id)
        .values(allocation_id=rerun_id)
    )
    why = f"host {host.name} is {host.status}"
    await record_timeline(session, alloc.allocation_id, "restart", "info", f"{why}: restarted elsewhere as {rerun_id}")
    old = await request_release(session, principal.actor, alloc.allocation_id, reason=f"replaced: {why}")
    requested = await with_volumes(session, rerun)
    await record_timeline(session, rerun_id, "status", "info", f"restart of allocation {alloc.allocation_id}: {why}")
    events: list[Event] = [
        allocation_events.AllocationRequested.build(data=alloc_state(requested), source=SERVICE, actor=principal.actor)
    ]
    waits_for = await limits_wait(
        session, alloc.tenant_id, alloc.project_id, alloc.gpu_model, alloc.gpu_count, queue=True
    )
    if waits_for is None and await others_waiting(session, alloc.gpu_model, rerun_id):
        waits_for = PendingReason.no_capacity
    placed: tuple[Any, list[int]] | None = None
    if waits_for is None:
        shape = CapacityShape(alloc.shape)
        try:
            placed = await place(
                session,
                shape=shape,
                model=alloc.gpu_model,
                count=alloc.gpu_count if shape is CapacityShape.gpu_slice else None,
                host_class=alloc.host_class,
                alloc_id=rerun_id,
                tenant_id=alloc.tenant_id,
                container_only=alloc.requested_runtime is not None,
                count_refusal=False,
            )
        except (Conflict, Unprocessable):  # no host fits (or none offers the model any more): it waits
            waits_for = PendingReason.no_capacity
    if placed is None:
        assert waits_for is not None
        row = await enqueue(session, requested, waits_for, events=events, actor=principal.actor)
    else:
        row = await admit(session, requested, *placed, events=events, actor=principal.actor)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.restart",
        resource_type="allocation",
        resource_id=alloc.allocation_id,
        tenant_id=alloc.tenant_id,
        project_id=alloc.project_id,
        before={"status": alloc.status, "host_id": str(alloc.host_id)},
        after={"status": old.status, "restarted_as": str(rerun_id), "restarted_as_status": row.status},
        reason=why,
    )
    return await changed(session, row)


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


async def record_app_member(session: AsyncSession, member: Any, *, tombstoned: bool) -> None:
    """app-runtime's member on an allocation (a projection the release saga counts); newer versions win."""
    values = {
        "member_id": member.member_id,
        "allocation_id": member.allocation_id,
        "status": str(member.status),
        "tombstoned": member.tombstoned or tombstoned,
        "version": member.version,
    }
    stmt = pg_insert(app_members).values(values)
    await session.execute(
        stmt.on_conflict_do_update(
            index_elements=["member_id"],
            set_={k: stmt.excluded[k] for k in values if k != "member_id"},
            where=app_members.c.version <= stmt.excluded.version,
        )
    )


async def release_allocation(
    session: AsyncSession,
    principal: Principal,
    alloc_id: uuid.UUID,
    *,
    retry: bool,
    expected_version: int | None = None,
) -> AllocationChange[Allocation]:
    action = "allocations.release"
    alloc = await load_allocation(session, principal, alloc_id, action, lock=True, expected_version=expected_version)
    if retry and alloc.status != AllocationStatus.release_failed:
        raise Conflict(
            f"only a release_failed allocation can be retried; this one is {alloc.status}",
            code="invalid_state_transition",
            current_status=alloc.status,
        )
    if not retry and alloc.status == AllocationStatus.release_failed:
        raise Conflict("the release failed; use retry-release", code="release_failed_use_retry")
    if alloc.status == AllocationStatus.queued:  # waiting: holds nothing, ends now (issue 29)
        row = await cancel_queued(session, alloc, principal.actor)
    else:
        row = await request_release(session, principal.actor, alloc_id, reason=None)
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
    return await changed(session, row)


async def request_release(
    session: AsyncSession, actor: Actor, alloc_id: uuid.UUID, *, reason: str | None, stop_timeout_s: float | None = None
) -> Any:
    """Billing stops here; the release task follows (after app-runtime's clearance when members run on it).
    `stop_timeout_s` (a preemption's stop): SIGTERM first, SIGKILL after that many seconds."""
    alloc = (
        await session.execute(select(allocations).where(allocations.c.allocation_id == alloc_id).with_for_update())
    ).one()
    retry = alloc.status == AllocationStatus.release_failed
    t = now()
    # Billing stops at the first release request, whatever happens to the release afterwards.
    row = await transition(
        session,
        alloc,
        AllocationStatus.releasing,
        release_requested_at=alloc.release_requested_at or t,
        billing_stopped_at=alloc.billing_stopped_at or t,
        release_attempts=alloc.release_attempts + 1,
        failure_reason=None,
        pending_resize_gpus=None,
        pending_resize_reason=None,
        pending_resize_since=None,
    )
    if alloc.pending_resize_gpus is not None:
        await record_timeline(session, alloc_id, "resize.queue", "failed", "the waiting resize ends with the release")
    if reason:
        await record_timeline(session, alloc_id, "release", "info", reason)
    await add_event(
        session, allocation_events.AllocationReleaseRequested.build(data=alloc_state(row), source=SERVICE, actor=actor)
    )
    members = 0 if retry else await live_app_members(session, alloc_id)
    if members:
        row = await update_allocation(session, alloc_id, awaiting_clearance_since=t)
        await record_timeline(
            session,
            alloc_id,
            "release.clearance",
            "started",
            f"waiting for app-runtime to stop {members} app member(s) on this allocation",
        )
    else:
        await enqueue_release(session, row, stop_timeout_s=stop_timeout_s)
    return row


async def enqueue_release(session: AsyncSession, alloc: Any, *, stop_timeout_s: float | None = None) -> None:
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
        vols.append(ReleaseVolume(volume_id=a.volume_id, delete_data=not a.persist and not others))
    await enqueue_task(
        session,
        alloc.host_id,
        alloc.allocation_id,
        ReleaseTask(
            allocation_id=alloc.allocation_id, username=alloc.ssh_username, volumes=vols, stop_timeout_s=stop_timeout_s
        ),
    )


async def clearance_granted(session: AsyncSession, alloc_id: uuid.UUID, *, forced: bool, note: str) -> None:
    alloc = (
        await session.execute(select(allocations).where(allocations.c.allocation_id == alloc_id).with_for_update())
    ).first()
    if alloc is None or alloc.status != AllocationStatus.releasing or alloc.awaiting_clearance_since is None:
        return
    row = await update_allocation(session, alloc_id, awaiting_clearance_since=None)
    await record_timeline(session, alloc_id, "release.clearance", "failed" if forced else "succeeded", note)
    await enqueue_release(session, row)


async def overdue_clearances(session: AsyncSession, timeout_s: float) -> list[uuid.UUID]:
    # Replicas' reconcilers lock these one by one (clearance_granted re-checks under the lock, so each is
    # forced once); in one fixed order, so two replicas never deadlock over the same set.
    rows = await session.execute(
        select(allocations.c.allocation_id)
        .where(
            allocations.c.awaiting_clearance_since < now() - timedelta(seconds=timeout_s),
            allocations.c.status == AllocationStatus.releasing,
        )
        .order_by(allocations.c.allocation_id)
    )
    return [r[0] for r in rows]
