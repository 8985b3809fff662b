"""Launchable apps (issue 21): the allocation a launchable instance runs in, created from app-runtime's
`instance.created` (its `launch` request) and released with the instance's decommission.

App-runtime checked the deploy (permission, entitlement, manifest active, inputs) in its own transaction and
chose the allocation's id; allocations creates it here in the consumer's transaction, with the same
placement, quota and limits rules as a user's create, on container hosts only, from the app's image —
accepted only when allocations' own projection of the catalog holds that digest at that reference as an
active artifact (or a canary of the tenant), so a forged or stale request cannot run anything else.
A launch that cannot be placed records a `failed` allocation with the reason (app-runtime fails the
instance from `allocation.failed`).

The workload (command, port, health path) goes into the allocation's `runtime` record and its provision /
restart tasks, with the per-instance secret (`gpuaas.kit.workload_tokens`) that only the task carries.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import insert, select

from gpuaas.allocations import SERVICE, domain
from gpuaas.allocations.models import allocations, catalog_artifacts
from gpuaas.allocations.service.common import SYSTEM, alloc_state, now, record_timeline, transition, with_volumes
from gpuaas.allocations.service.host_classes import limits_for
from gpuaas.allocations.service.lifecycle import request_release, start_provisioning
from gpuaas.allocations.service.placement import place
from gpuaas.allocations.service.quotas import check_quota
from gpuaas.contracts import Actor, Event
from gpuaas.contracts.enums import AllocationStatus, CapacityShape
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.contracts.events.app_runtime import InstanceState
from gpuaas.kit import audit, workload_tokens
from gpuaas.kit.errors import Problem
from gpuaas.kit.outbox import add_events


async def _artifact_offered(session: Any, image: str, digest: str, tenant_id: uuid.UUID) -> str | None:
    """None when the catalog (as projected here) offers this image at this digest to the tenant, else why not."""
    rows = (
        await session.execute(
            select(catalog_artifacts).where(catalog_artifacts.c.digest == digest, catalog_artifacts.c.ref == image)
        )
    ).all()
    if not rows:
        return f"the catalog holds no artifact {image}"
    for r in rows:
        if r.state == "active" or (r.state == "canary" and str(tenant_id) in set(r.canary_tenants or [])):
            return None
    return f"the app's artifact is {rows[0].state}"


async def launch_allocation(session: Any, inst: InstanceState, actor: Actor) -> None:
    """Create the launch allocation of `inst` (idempotent by its id) and queue its provision task."""
    launch = inst.launch
    if launch is None:
        return
    alloc_id = launch.allocation_id
    if (
        await session.execute(select(allocations.c.allocation_id).where(allocations.c.allocation_id == alloc_id))
    ).first():
        return
    t = now()
    workload = allocation_events.WorkloadSpec.model_validate(launch.workload).model_dump(mode="json")
    runtime = {
        "slug": launch.app_slug,
        "version": launch.app_version,
        "image": launch.image,
        "digest": launch.digest,
        "workload": workload,
    }
    await session.execute(
        insert(allocations).values(
            allocation_id=alloc_id,
            tenant_id=inst.tenant_id,
            project_id=inst.project_id,
            owner_user_id=launch.owner_user_id,
            name=f"{inst.name or launch.app_slug} ({launch.app_slug})"[:100],
            shape=CapacityShape.gpu_slice,
            gpu_model=launch.gpu_model,
            gpu_count=launch.gpu_count,
            gpu_indices=[],
            host_class=None,
            status=AllocationStatus.requested,
            status_changed_at=t,
            ssh_username=domain.unix_username(alloc_id),
            requested_at=t,
            runtime=runtime,
        )
    )
    requested = await with_volumes(
        session, (await session.execute(select(allocations).where(allocations.c.allocation_id == alloc_id))).one()
    )
    events: list[Event] = [
        allocation_events.AllocationRequested.build(data=alloc_state(requested), source=SERVICE, actor=actor)
    ]
    await record_timeline(session, alloc_id, "status", "info", f"requested by app instance {inst.instance_id} (launch)")
    nested = await session.begin_nested()
    try:
        if (why := await _artifact_offered(session, launch.image, launch.digest, inst.tenant_id)) is not None:
            raise Problem(f"the app's image cannot run: {why}")
        workload_tokens.key_from_env()  # refuse now rather than at the agent
        await check_quota(session, inst.project_id, launch.gpu_count)
        host, picked = await place(
            session,
            shape=CapacityShape.gpu_slice,
            model=launch.gpu_model,
            count=launch.gpu_count,
            host_class=None,
            alloc_id=alloc_id,
            tenant_id=inst.tenant_id,
            container_only=True,
        )
        limits = await limits_for(session, host, gpu_count=len(picked))
    except (Problem, workload_tokens.WorkloadTokenKeyMissing) as exc:
        await nested.rollback()
        reason = getattr(exc, "detail", None) or str(exc)
        row = await transition(session, requested, AllocationStatus.failed, failure_reason=f"launch failed: {reason}")
        events.append(allocation_events.AllocationFailed.build(data=alloc_state(row), source=SERVICE, actor=actor))
        await add_events(session, events)
        return
    await nested.commit()
    await start_provisioning(
        session,
        requested,
        host,
        picked,
        runtime=runtime,
        limits=limits,
        note=f"; image {launch.app_slug} {launch.app_version} ({launch.digest}); workload on port "
        f"{workload['port']}, health {workload['health_path']}",
        events=events,
        actor=actor,
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=SYSTEM,
        action="allocations.launch",
        resource_type="allocation",
        resource_id=alloc_id,
        tenant_id=inst.tenant_id,
        project_id=inst.project_id,
        after={"instance_id": str(inst.instance_id), "app": launch.app_slug, "digest": launch.digest},
    )


async def release_launch_allocation(session: Any, inst: InstanceState, actor: Actor) -> None:
    """The instance is being decommissioned: release its launch allocation (idempotent)."""
    if inst.launch is None:
        return

    alloc = (
        await session.execute(select(allocations).where(allocations.c.allocation_id == inst.launch.allocation_id))
    ).first()
    if alloc is None or alloc.status != AllocationStatus.active:
        return  # still provisioning: released when app-runtime sees it active for a decommissioned instance
    await request_release(session, actor, alloc.allocation_id, reason=f"app instance {inst.instance_id} decommissioned")
