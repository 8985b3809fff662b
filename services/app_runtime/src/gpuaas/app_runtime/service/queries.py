"""What users and controllers read: instances, their members and operations, and the instance timeline
(whose entries controllers may add to)."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime.models import instance_events, instances, members, operations
from gpuaas.app_runtime.service.common import (
    check_controller,
    controller_instance,
    controller_project,
    readable_instance,
    timeline,
)
from gpuaas.app_runtime.service.views import InstanceView, MemberView, OperationView, TimelineEntryView, from_row
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.kit import iam, paging
from gpuaas.kit.auth import Principal


async def list_instances(
    session: AsyncSession,
    principal: Principal,
    *,
    project_id: uuid.UUID | None,
    app_slug: str | None,
    status: InstanceStatus | None,
    page: paging.PageRequest,
) -> tuple[list[InstanceView], str | None]:
    """The instances the caller may see (newest first), filtered: one page (keyset on instance_id)
    and the next page's cursor (None on the last)."""
    visible = await iam.visible_project_ids(session, principal)
    stmt = select(instances)
    if visible is not None:
        stmt = stmt.where(instances.c.project_id.in_(list(visible)))
    if project_id is not None:
        stmt = stmt.where(instances.c.project_id == project_id)
    if app_slug is not None:
        stmt = stmt.where(instances.c.app_slug == app_slug)
    if status is not None:
        stmt = stmt.where(instances.c.status == status)
    rows = (await session.execute(paging.keyset(stmt, [instances.c.instance_id], page))).all()
    kept, next_cursor = paging.split(rows, page, lambda r: (r.instance_id,))
    return [from_row(InstanceView, r) for r in kept], next_cursor


async def list_members(
    session: AsyncSession, principal: Principal, instance_id: uuid.UUID, *, include_tombstones: bool
) -> list[MemberView]:
    await readable_instance(session, principal, instance_id)
    stmt = select(members).where(members.c.instance_id == instance_id)
    if not include_tombstones:
        stmt = stmt.where(members.c.tombstoned.is_(False))
    rows = await session.execute(stmt.order_by(members.c.created_at, members.c.member_id))
    return [from_row(MemberView, r) for r in rows]


async def list_operations(session: AsyncSession, principal: Principal, instance_id: uuid.UUID) -> list[OperationView]:
    await readable_instance(session, principal, instance_id)
    rows = await session.execute(
        select(operations).where(operations.c.instance_id == instance_id).order_by(operations.c.operation_id)
    )
    return [from_row(OperationView, r) for r in rows]


# ------------------------------------------------------------------------------------------ the controller's view


async def controller_instances(
    session: AsyncSession, principal: Principal, app_slug: str, *, include_final: bool
) -> list[InstanceView]:
    """Desired state of every instance of the controller's app in its project."""
    project_id = controller_project(principal)
    await check_controller(session, principal, project_id, app_slug)
    stmt = select(instances).where(instances.c.project_id == project_id, instances.c.app_slug == app_slug)
    if not include_final:
        stmt = stmt.where(instances.c.status != InstanceStatus.decommissioned)
    return [from_row(InstanceView, r) for r in await session.execute(stmt.order_by(instances.c.instance_id))]


async def controller_members(session: AsyncSession, principal: Principal, instance_id: uuid.UUID) -> list[MemberView]:
    """Every member of the instance, tombstones included."""
    await controller_instance(session, principal, instance_id)
    rows = await session.execute(
        select(members).where(members.c.instance_id == instance_id).order_by(members.c.created_at)
    )
    return [from_row(MemberView, r) for r in rows]


# ------------------------------------------------------------------------------------------ timeline


async def timeline_since(
    session: AsyncSession, instance_id: uuid.UUID, after: int, limit: int
) -> list[TimelineEntryView]:
    """Timeline entries after `after` (their seq), oldest first; the caller has checked who asks."""
    rows = await session.execute(
        select(instance_events)
        .where(instance_events.c.instance_id == instance_id, instance_events.c.seq > after)
        .order_by(instance_events.c.seq)
        .limit(limit)
    )
    return [from_row(TimelineEntryView, r) for r in rows]


async def timeline_entries(
    session: AsyncSession, principal: Principal, instance_id: uuid.UUID, *, after: int, limit: int
) -> list[TimelineEntryView]:
    await readable_instance(session, principal, instance_id)
    return await timeline_since(session, instance_id, after, limit)


async def controller_event(
    session: AsyncSession,
    principal: Principal,
    instance_id: uuid.UUID,
    *,
    kind: str,
    message: str,
    data: dict[str, Any],
) -> TimelineEntryView:
    """An adapter event (e.g. `slurm.partition_ready`) on the instance timeline, as `controller.<kind>`."""
    await controller_instance(session, principal, instance_id)
    return await timeline(session, instance_id, f"controller.{kind}", message, principal.actor, **data)
