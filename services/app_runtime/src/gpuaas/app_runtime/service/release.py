"""The release saga, app_runtime's part: when allocations asks to release an allocation, every member on it
is removed first (or, not yet started, dropped), and `release_clearance.granted` tells allocations it may
go on. A clearance that takes longer than the timeout is granted as forced (the reconciler), with what
could not be stopped recorded.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime import domain
from gpuaas.app_runtime.models import members, operations, release_requests
from gpuaas.app_runtime.service.common import (
    OPEN_STATUSES,
    SYSTEM,
    cancel_open_operation,
    emit,
    insert_operation,
    load_instance,
    now,
    on_member,
    open_operations,
    recompute_instance,
    set_instance_status,
    timeline,
    tombstone_member,
)
from gpuaas.app_runtime.service.credentials import sync_grant
from gpuaas.app_runtime.service.views import MemberView, from_row
from gpuaas.contracts import Actor
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events import app_runtime as app_runtime_events
from gpuaas.contracts.events.app_runtime import MemberStatus, OperationKind, OperationStatus, ReleaseClearance


async def allocation_release_requested(
    session: AsyncSession, allocation_id: uuid.UUID, tenant_id: uuid.UUID, project_id: uuid.UUID
) -> None:
    """Stop/remove every member on an allocation that is being released, then clear the release."""
    stmt = pg_insert(release_requests).values(allocation_id=allocation_id, tenant_id=tenant_id, project_id=project_id)
    await session.execute(
        stmt.on_conflict_do_update(
            index_elements=["allocation_id"], set_={"requested_at": now(), "cleared_at": None, "forced": False}
        )
    )
    rows = await session.execute(
        select(members)
        .where(members.c.allocation_id == allocation_id, members.c.tombstoned.is_(False))
        .with_for_update()
    )
    on_it = [from_row(MemberView, r) for r in rows]
    for member in on_it:
        await _remove_for_release(session, member, allocation_id)
    for instance_id in {m.instance_id for m in on_it}:
        inst = await load_instance(session, instance_id, lock=True)
        if inst.status in (InstanceStatus.running, InstanceStatus.created, InstanceStatus.starting):
            await set_instance_status(
                session, inst, InstanceStatus.degraded, SYSTEM, f"allocation {allocation_id} is being released"
            )
    await check_release(session, allocation_id, SYSTEM)


async def _remove_for_release(session: AsyncSession, member: MemberView, allocation_id: uuid.UUID) -> None:
    """One `remove` for a member on a released allocation (unless one is open already); whatever else was
    in flight on it is moot now, and a member that never started is simply dropped."""
    inst = await load_instance(session, member.instance_id, lock=True)
    open_remove = (
        await session.execute(
            select(operations.c.operation_id).where(
                operations.c.member_id == member.member_id,
                operations.c.kind == OperationKind.remove,
                operations.c.status.in_(OPEN_STATUSES),
            )
        )
    ).first()
    if open_remove is not None:
        return
    for op in await open_operations(session, on_member(member.member_id)):
        why = "allocation released"
        await cancel_open_operation(session, op, SYSTEM, why, f"{op.kind} cancelled: {why}")
    if member.status == MemberStatus.pending:
        await tombstone_member(
            session, member.member_id, SYSTEM, f"allocation {allocation_id} released before the member started"
        )
        return
    await timeline(
        session,
        inst.instance_id,
        "allocation.releasing",
        f"allocation {allocation_id} is being released: removing {member.component_key} member first",
        SYSTEM,
        allocation_id=allocation_id,
        member_id=member.member_id,
    )
    await insert_operation(
        session,
        inst,
        OperationKind.remove,
        SYSTEM,
        member=member,
        params={"reason": "allocation_release", "cascade": True, "verify_teardown": True},
    )


async def check_release(session: AsyncSession, allocation_id: uuid.UUID, actor: Actor, *, force: bool = False) -> None:
    """Grant the clearance of a requested release once no live member is left on the allocation (with
    `force`: now, tombstoning what is left)."""
    req = (
        await session.execute(
            select(release_requests).where(release_requests.c.allocation_id == allocation_id).with_for_update()
        )
    ).first()
    if req is None or req.cleared_at is not None:
        return
    remaining = [
        from_row(MemberView, r)
        for r in await session.execute(
            select(members).where(members.c.allocation_id == allocation_id, members.c.tombstoned.is_(False))
        )
    ]
    forced = req.forced
    if remaining and not force:
        return
    for member in remaining:  # forced: the release goes on; what we could not stop is recorded
        for op in await open_operations(session, on_member(member.member_id)):
            why = "release clearance timed out"
            await cancel_open_operation(session, op, actor, why, f"{op.kind} cancelled: {why}")
        await tombstone_member(
            session, member.member_id, actor, f"allocation {allocation_id} released without verified teardown"
        )
        forced = True
    failed = (
        await session.execute(
            select(func.count()).where(
                operations.c.allocation_id == allocation_id,
                operations.c.kind == OperationKind.remove,
                operations.c.status.in_([OperationStatus.failed, OperationStatus.cancelled]),
                operations.c.created_at >= req.requested_at,
            )
        )
    ).scalar_one()
    forced = forced or failed > 0
    stopped = (
        await session.execute(
            select(members.c.member_id, members.c.instance_id).where(
                members.c.allocation_id == allocation_id, members.c.status_changed_at >= req.requested_at
            )
        )
    ).all()
    at = now()
    await session.execute(
        update(release_requests)
        .where(release_requests.c.allocation_id == allocation_id)
        .values(cleared_at=at, forced=forced)
    )
    clearance = ReleaseClearance(
        allocation_id=allocation_id,
        tenant_id=req.tenant_id,
        project_id=req.project_id,
        stopped_member_ids=[s.member_id for s in stopped],
        instance_ids=sorted({s.instance_id for s in stopped}),
        forced=forced,
        cleared_at=at,
    )
    await emit(session, app_runtime_events.ReleaseClearanceGranted, clearance, actor)
    for instance_id in {s.instance_id for s in stopped}:
        await timeline(
            session,
            instance_id,
            "allocation.cleared",
            f"allocation {allocation_id} cleared for release" + (" (forced)" if forced else ""),
            actor,
            allocation_id=allocation_id,
            forced=forced,
        )
        inst = await load_instance(session, instance_id, lock=True)
        if inst.status in domain.LIVE_INSTANCE:
            await recompute_instance(session, instance_id, actor)
        await sync_grant(session, instance_id, actor)


async def overdue_releases(session: AsyncSession, timeout_s: int) -> int:
    """Grant, as forced, the clearances that waited longer than `timeout_s` (the reconciler)."""
    rows = (
        await session.execute(
            select(release_requests.c.allocation_id)
            .where(
                release_requests.c.cleared_at.is_(None),
                release_requests.c.requested_at < now() - timedelta(seconds=timeout_s),
            )
            .with_for_update(skip_locked=True)
        )
    ).all()
    for r in rows:
        await check_release(session, r.allocation_id, SYSTEM, force=True)
    return len(rows)
