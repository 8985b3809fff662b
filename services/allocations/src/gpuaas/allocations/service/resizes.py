"""Resizing a gpu_slice on its host: grow (GPUs reserved now, or a resize that waits as `pending_resize_gpus`
while the allocation runs on, granted later by the admission runner through `start_resize`), shrink, and cancel a
waiting resize (issue 29)."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import SERVICE, domain
from gpuaas.allocations.metrics import refused
from gpuaas.allocations.models import gpu_assignments, hosts
from gpuaas.allocations.service.common import (
    alloc_state,
    container_limits,
    enqueue_task,
    load_allocation,
    runtime_image,
    transition,
    workload_payload,
)
from gpuaas.allocations.service.host_classes import limits_for
from gpuaas.allocations.service.lifecycle import changed
from gpuaas.allocations.service.overlay import overlay_for
from gpuaas.allocations.service.placement import capacities
from gpuaas.allocations.service.waiting import cancel_resize, limits_wait, others_waiting, queue_resize
from gpuaas.allocations.views import Allocation, AllocationChange
from gpuaas.contracts import Actor
from gpuaas.contracts.agent import ResizeTask
from gpuaas.contracts.enums import AllocationStatus, CapacityShape, PendingReason
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.kit import audit
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict
from gpuaas.kit.outbox import add_event


async def resize_allocation(
    session: AsyncSession,
    principal: Principal,
    alloc_id: uuid.UUID,
    gpu_count: int,
    *,
    queue: bool = True,
    expected_version: int | None = None,
) -> AllocationChange[Allocation]:
    """Grow or shrink a gpu_slice on its host. `queue` (issue 29): a resize up that cannot be granted now (its
    host lacks free GPUs, its project is at its quota or queue limit, or others of the pool wait for GPUs)
    waits as `pending_resize_gpus` while the allocation runs on; `queue=False` answers the 409 at once. A size
    the host can never give (more GPUs of the model than it has) is always 409 `insufficient_gpus_on_host`."""
    alloc = await load_allocation(
        session, principal, alloc_id, "allocations.update", lock=True, expected_version=expected_version
    )
    if alloc.shape != CapacityShape.gpu_slice:
        raise Conflict(
            "only a gpu_slice can be resized; a baremetal allocation holds the whole host", code="resize_not_supported"
        )
    domain.check_transition(alloc.status, AllocationStatus.resizing, action="resize")
    if alloc.pending_resize_gpus is not None:
        raise Conflict(
            f"a resize to {alloc.pending_resize_gpus} GPUs already waits; cancel it first (DELETE .../resize)",
            code="resize_pending",
            pending_resize_gpus=alloc.pending_resize_gpus,
        )
    if gpu_count == alloc.gpu_count:
        raise Conflict(f"the allocation already has {gpu_count} GPUs", code="resize_noop")
    current = sorted(alloc.gpu_indices)
    if gpu_count > alloc.gpu_count:
        need = gpu_count - alloc.gpu_count
        waits_for = await limits_wait(session, alloc.tenant_id, alloc.project_id, alloc.gpu_model, need, queue=queue)
        await session.execute(select(hosts.c.host_id).where(hosts.c.host_id == alloc.host_id).with_for_update())
        cap = (await capacities(session, [alloc.host_id]))[0]
        free = cap.free(alloc.gpu_model)
        never = gpu_count > len(cap.gpu_indices_by_model.get(alloc.gpu_model, []))
        if never or (len(free) < need and not queue):
            refused(session, "insufficient_gpus_on_host")
            raise Conflict(
                f"the host has {len(free)} free {alloc.gpu_model} GPUs; growing to {gpu_count} needs {need}",
                code="insufficient_gpus_on_host",
                free=len(free),
                needed=need,
            )
        if waits_for is None and (
            len(free) < need or (queue and await others_waiting(session, alloc.gpu_model, alloc_id))
        ):
            waits_for = PendingReason.no_capacity
        if waits_for is not None:
            row = await queue_resize(session, alloc, gpu_count, waits_for, principal.actor)
            await _audit_resize(
                session, principal, alloc, {"pending_resize_gpus": gpu_count, "reason": waits_for.value}
            )
            return await changed(session, row)
        extra = sorted(free)[:need]
        await session.execute(
            insert(gpu_assignments),
            [{"host_id": alloc.host_id, "gpu_index": i, "allocation_id": alloc_id} for i in extra],
        )
        target = sorted(current + extra)
    else:
        target = current[:gpu_count]
    row = await start_resize(session, alloc, target, actor=principal.actor)
    await _audit_resize(session, principal, alloc, {"gpu_count": gpu_count, "gpu_indices": target})
    return await changed(session, row)


async def _audit_resize(session: AsyncSession, principal: Principal, alloc: Any, after: dict[str, Any]) -> None:
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.resize",
        resource_type="allocation",
        resource_id=alloc.allocation_id,
        tenant_id=alloc.tenant_id,
        project_id=alloc.project_id,
        before={"gpu_count": alloc.gpu_count, "gpu_indices": sorted(alloc.gpu_indices)},
        after=after,
    )


async def start_resize(session: AsyncSession, alloc: Any, target: list[int], *, actor: Actor) -> Any:
    """active -> resizing to the GPUs `target` (any extra ones already reserved), a waiting resize cleared,
    allocation.resizing in the outbox and the resize task queued (the request, and admission granting a wait)."""
    host = (await session.execute(select(hosts).where(hosts.c.host_id == alloc.host_id))).one()
    limits = await limits_for(session, host, gpu_count=len(target))
    row = await transition(
        session,
        alloc,
        AllocationStatus.resizing,
        target_gpu_count=len(target),
        target_gpu_indices=target,
        failure_reason=None,
        pending_resize_gpus=None,
        pending_resize_reason=None,
        pending_resize_since=None,
    )
    await add_event(
        session, allocation_events.AllocationResizing.build(data=alloc_state(row), source=SERVICE, actor=actor)
    )
    workload, workload_token = workload_payload(row.runtime)
    await enqueue_task(
        session,
        row.host_id,
        row.allocation_id,
        ResizeTask(
            allocation_id=row.allocation_id,
            username=row.ssh_username,
            gpu_indices=target,
            runtime=runtime_image(row.runtime),
            limits=container_limits(limits if row.runtime else None),
            workload=workload,
            workload_token=workload_token,
            overlay=await overlay_for(session, row),  # the container is recreated: same address, peers as now
        ),
    )
    return row


async def cancel_pending_resize(
    session: AsyncSession, principal: Principal, alloc_id: uuid.UUID, *, expected_version: int | None = None
) -> AllocationChange[Allocation]:
    """Cancel a resize that waits (nothing was reserved for it): 409 `no_pending_resize` when none waits."""
    alloc = await load_allocation(
        session, principal, alloc_id, "allocations.update", lock=True, expected_version=expected_version
    )
    if alloc.pending_resize_gpus is None:
        raise Conflict("no resize waits for this allocation", code="no_pending_resize")
    row = await cancel_resize(session, alloc, principal.actor, f"resize to {alloc.pending_resize_gpus} GPUs cancelled")
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.resize_cancel",
        resource_type="allocation",
        resource_id=alloc_id,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        before={"pending_resize_gpus": alloc.pending_resize_gpus},
        after={"pending_resize_gpus": None},
    )
    return await changed(session, row)
