"""Preemption notices as drain requests: when allocations schedules the preemption of an allocation
(`allocation.preemption_scheduled`), every live member on it gets one `drain` operation whose deadline is the
preemption's, so its controller moves work off before the allocation is stopped. The release at the deadline
then removes the member through the release saga (`release`), as for any released allocation.

One drain per notice: the drain carries the notice (`params.preemption`), and a member that already has one
for it, is leaving, or has an operation open gets none (`domain.preemption_drain_skip`).
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime import domain
from gpuaas.app_runtime.models import members, operations
from gpuaas.app_runtime.service.common import (
    SYSTEM,
    insert_operation,
    load_instance,
    load_member,
    now,
    on_member,
    open_operations,
    timeline,
    update_instance,
)
from gpuaas.app_runtime.service.ordering import reoffer_deferred
from gpuaas.contracts.events.allocations import PreemptionNotice
from gpuaas.contracts.events.app_runtime import OperationKind

REASON = "preemption"


def drain_params(notice: PreemptionNotice) -> dict[str, Any]:
    """The drain's parameters: its deadline as a time (`deadline_at`, what the SDK bounds the drain by) and,
    for controllers that only read a length, the seconds left when it was requested (`deadline_s`)."""
    left = int((notice.deadline - now()).total_seconds())
    return {
        "reason": REASON,
        "deadline_at": notice.deadline.isoformat(),
        "deadline_s": max(left, 1),
        "preemption": notice.model_dump(mode="json"),
    }


async def allocation_preemption_scheduled(
    session: AsyncSession, allocation_id: uuid.UUID, notice: PreemptionNotice
) -> list[uuid.UUID]:
    """One drain for each live member on the allocation (the operations' ids); each instance's timeline says
    why, or why a member gets none."""
    rows = await session.execute(
        select(members.c.member_id, members.c.instance_id)
        .where(members.c.allocation_id == allocation_id, members.c.tombstoned.is_(False))
        .order_by(members.c.member_id)
    )
    drains: list[uuid.UUID] = []
    for member_id, instance_id in rows.all():
        # the instance, then its member: the lock order of a requested operation
        inst = await load_instance(session, instance_id, lock=True)
        member = await load_member(session, member_id, lock=True)
        if member.tombstoned or await _drained_for(session, member_id, notice):
            continue  # gone meanwhile, or the same notice again (redelivered, replayed): its drain exists
        open_kinds = [op.kind for op in await open_operations(session, on_member(member.member_id))]
        skip = domain.preemption_drain_skip(inst.status, member.status, open_kinds)
        what = (
            f"allocation {allocation_id} is preempted at {notice.deadline.isoformat()} ({notice.reason}): "
            f"{member.component_key} member {member.member_id}"
        )
        await timeline(
            session,
            inst.instance_id,
            "member.preemption_scheduled",
            f"{what} not drained: {skip}" if skip else f"{what} is drained first",
            SYSTEM,
            reason=REASON,
            allocation_id=allocation_id,
            member_id=member.member_id,
            deadline=notice.deadline.isoformat(),
            preemption_reason=notice.reason,
        )
        if skip:
            continue
        await reoffer_deferred(session, inst.instance_id)
        op = await insert_operation(
            session, inst, OperationKind.drain, SYSTEM, member=member, params=drain_params(notice)
        )
        await update_instance(session, inst.instance_id, SYSTEM)  # a new operation moves the instance's version
        drains.append(op.operation_id)
    return drains


async def _drained_for(session: AsyncSession, member_id: uuid.UUID, notice: PreemptionNotice) -> bool:
    """Whether the member has a drain for this notice already (whatever became of it)."""
    scheduled_at = notice.model_dump(mode="json")["scheduled_at"]
    found = await session.execute(
        select(operations.c.operation_id).where(
            operations.c.member_id == member_id,
            operations.c.kind == OperationKind.drain,
            operations.c.params["preemption"]["scheduled_at"].astext == scheduled_at,
        )
    )
    return found.first() is not None
