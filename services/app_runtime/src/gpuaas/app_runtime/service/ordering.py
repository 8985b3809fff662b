"""Which claimable operation a controller gets: the oldest one that is not deferred and that the app's role
ordering (a manifest role's `after`, `domain.ordering_hold`) does not hold back; and re-offering deferred
operations when their instance changes.

Nothing here commits: the caller owns the transaction.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, and_, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime import domain
from gpuaas.app_runtime.models import operations
from gpuaas.app_runtime.service.common import OPEN_STATUSES, live_members, load_instance
from gpuaas.app_runtime.service.instance_records import load_manifest
from gpuaas.app_runtime.service.views import OperationView, from_row
from gpuaas.contracts.events.app_runtime import OperationStatus

# How many of the oldest claimable operations a claim looks through for one that is not held back.
CANDIDATES = 50


def claimable(at: datetime) -> ColumnElement[bool]:
    """Pending, or held by a lease that ran out."""
    return or_(
        operations.c.status == OperationStatus.pending,
        and_(
            operations.c.status.in_([OperationStatus.claimed, OperationStatus.in_progress]),
            operations.c.lease_expires_at < at,
        ),
    )


def not_deferred(at: datetime) -> ColumnElement[bool]:
    return or_(operations.c.deferred_until.is_(None), operations.c.deferred_until <= at)


@dataclass(frozen=True)
class _InstanceOrder:
    """What the role ordering needs of one instance, read once per claim."""

    order: dict[str, frozenset[str]]
    members: list[tuple[str, str]]
    open_operations: list[domain.OpenOperation]


async def _instance_order(session: AsyncSession, instance_id: uuid.UUID) -> _InstanceOrder:
    inst = await load_instance(session, instance_id)
    order = domain.role_order((await load_manifest(session, inst.manifest_id)).state.get("roles") or [])
    if not order:
        return _InstanceOrder({}, [], [])
    members = [(m.component_key, m.status) for m in await live_members(session, instance_id)]
    # read without locking: a claim locks only the operation it takes (no lock order between claimers)
    rows = await session.execute(
        select(operations.c.operation_id, operations.c.kind, operations.c.component_key).where(
            operations.c.instance_id == instance_id, operations.c.status.in_(OPEN_STATUSES)
        )
    )
    return _InstanceOrder(order, members, [domain.OpenOperation(*r) for r in rows])


def _hold(op: OperationView, seen: _InstanceOrder) -> str | None:
    others = [o for o in seen.open_operations if o.operation_id != op.operation_id]
    return domain.ordering_hold(op.kind, op.component_key, seen.order, seen.members, others)


async def ordering_hold(session: AsyncSession, op: OperationView) -> str | None:
    """Why the app's role ordering holds `op` back now (None: it may be handed out)."""
    if op.component_key is None:
        return None
    return _hold(op, await _instance_order(session, op.instance_id))


async def next_claimable(
    session: AsyncSession, project_id: uuid.UUID, app_slug: str, at: datetime
) -> OperationView | None:
    """The oldest claimable operation of the app that is neither deferred nor held back by the role ordering,
    locked (`SKIP LOCKED`: concurrent claimers get different ones); None when there is none. Each instance's
    ordering is read once per call, however many of its operations are looked at."""
    rows = await session.execute(
        select(operations)
        .where(
            operations.c.project_id == project_id,
            operations.c.app_slug == app_slug,
            claimable(at),
            not_deferred(at),
        )
        .order_by(operations.c.operation_id)
        .limit(CANDIDATES)
    )
    seen: dict[uuid.UUID, _InstanceOrder] = {}
    for candidate in [from_row(OperationView, r) for r in rows]:
        if candidate.component_key is not None:
            if candidate.instance_id not in seen:
                seen[candidate.instance_id] = await _instance_order(session, candidate.instance_id)
            if _hold(candidate, seen[candidate.instance_id]) is not None:
                continue
        locked = (
            await session.execute(
                select(operations)
                .where(operations.c.operation_id == candidate.operation_id, claimable(at), not_deferred(at))
                .with_for_update(skip_locked=True)
            )
        ).first()
        if locked is not None:
            return from_row(OperationView, locked)
    return None


async def reoffer_deferred(session: AsyncSession, instance_id: uuid.UUID) -> None:
    """Something changed in the instance: its deferred operations are offered again now."""
    await session.execute(
        update(operations)
        .where(
            operations.c.instance_id == instance_id,
            operations.c.status == OperationStatus.pending,
            operations.c.deferred_until.is_not(None),
        )
        .values(deferred_until=None)
    )
