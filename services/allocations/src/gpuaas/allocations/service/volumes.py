"""Volumes: project storage created, attached to and detached from allocations, deleted."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import SERVICE
from gpuaas.allocations.models import volume_attachments, volumes
from gpuaas.allocations.service.common import (
    SYSTEM,
    enqueue_task,
    load_allocation,
    now,
    record_timeline,
    update_allocation,
)
from gpuaas.allocations.views import AllocationChange
from gpuaas.contracts import Actor, new_event_id
from gpuaas.contracts.agent import AttachVolumeTask, DetachVolumeTask, VolumeMount
from gpuaas.contracts.enums import AllocationStatus
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.contracts.events.allocations import VolumeAttachment, VolumeState
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound, Unprocessable
from gpuaas.kit.outbox import add_event


async def volume_mounts(session: AsyncSession, alloc_id: uuid.UUID) -> list[VolumeMount]:
    """Where the allocation's volumes are mounted (what its provision/restart task carries)."""
    rows = await session.execute(
        select(volume_attachments.c.volume_id, volume_attachments.c.mount_path).where(
            volume_attachments.c.allocation_id == alloc_id
        )
    )
    return [VolumeMount(volume_id=r.volume_id, mount_path=r.mount_path) for r in rows]


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
    await add_event(session, allocation_events.VolumeCreated.build(data=state, source=SERVICE, actor=principal.actor))
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


async def get_volume(session: AsyncSession, principal: Principal, volume_id: uuid.UUID) -> VolumeState:
    return await volume_state(session, await load_volume(session, principal, volume_id, "allocations.read"))


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


async def attach_to_allocation(
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
    state = await _set_volume_status(session, volume_id, "attached")
    await add_event(session, allocation_events.VolumeAttached.build(data=state, source=SERVICE, actor=principal.actor))
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
    await record_timeline(session, alloc_id, "storage", "info", f"volume {vol.name} attached at {mount_path}")
    if emit_task and host_id is not None:
        await enqueue_task(
            session,
            host_id,
            alloc_id,
            AttachVolumeTask(allocation_id=alloc_id, volume_id=volume_id, mount_path=mount_path),
        )
    return state


async def _active_allocation(
    session: AsyncSession, principal: Principal, alloc_id: uuid.UUID, expected_version: int | None, what: str
) -> Any:
    """The allocation a volume change applies to: locked, at the expected version, and active."""
    alloc = await load_allocation(
        session, principal, alloc_id, "allocations.update", lock=True, expected_version=expected_version
    )
    if alloc.status != AllocationStatus.active:
        raise Conflict(f"{what} active allocations; this one is {alloc.status}", code="allocation_not_active")
    return alloc


async def attach_volume(
    session: AsyncSession,
    principal: Principal,
    alloc_id: uuid.UUID,
    volume_id: uuid.UUID,
    *,
    expected_version: int | None = None,
) -> AllocationChange[VolumeState]:
    """Attach to an active allocation. Its volume ids are part of the allocation, so its version moves on."""
    alloc = await _active_allocation(session, principal, alloc_id, expected_version, "volumes attach to")
    state = await attach_to_allocation(
        session, principal, alloc_id, alloc.project_id, volume_id, emit_task=True, host_id=alloc.host_id
    )
    row = await update_allocation(session, alloc_id)
    return AllocationChange(body=state, version=row.version, host_id=row.host_id)


async def detach_volume(
    session: AsyncSession,
    principal: Principal,
    alloc_id: uuid.UUID,
    volume_id: uuid.UUID,
    *,
    expected_version: int | None = None,
) -> AllocationChange[VolumeState]:
    """Detach from an active allocation (the data stays); the allocation's version moves on."""
    alloc = await _active_allocation(session, principal, alloc_id, expected_version, "volumes detach from")
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
    row = await update_allocation(session, alloc_id)
    await enqueue_task(
        session,
        alloc.host_id,
        alloc_id,
        DetachVolumeTask(allocation_id=alloc_id, volume_id=volume_id, mount_path=gone.mount_path, delete_data=False),
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
    await record_timeline(session, alloc_id, "storage", "info", f"volume {state.name} detached")
    return AllocationChange(body=state, version=row.version, host_id=row.host_id)


async def _set_volume_status(session: AsyncSession, volume_id: uuid.UUID, status: str) -> VolumeState:
    row = (
        await session.execute(
            update(volumes)
            .where(volumes.c.volume_id == volume_id)
            .values(status=status, version=volumes.c.version + 1)
            .returning(*volumes.c)
        )
    ).one()
    return await volume_state(session, row)


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
    state = await _set_volume_status(session, volume_id, status)
    await add_event(session, allocation_events.VolumeDetached.build(data=state, source=SERVICE, actor=actor))
    if status == "deleted":
        await add_event(session, allocation_events.VolumeDeleted.build(data=state, source=SERVICE, actor=actor))
    return state


async def detach_all(session: AsyncSession, alloc_id: uuid.UUID, *, deleting: bool) -> None:
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
    state = await _set_volume_status(session, volume_id, "deleted")
    await add_event(session, allocation_events.VolumeDeleted.build(data=state, source=SERVICE, actor=principal.actor))
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
