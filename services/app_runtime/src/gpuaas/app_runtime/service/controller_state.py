"""A controller's own state per instance (the SDK's `StoredState`): read and compare-and-set by the instance's
bound controller only. The platform keeps it opaque; the version makes replicas of one controller safe:
a write names the version it read (0 when there was none) and loses with 409 when another write came first.
No audit record per write (bookkeeping written on every reconcile would drown the audit trail); the
timeline carries what matters to people."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime.domain import check_controller_state_write
from gpuaas.app_runtime.models import controller_states
from gpuaas.app_runtime.service.common import controller_instance, now
from gpuaas.kit.auth import Principal


@dataclass(frozen=True)
class ControllerStateView:
    instance_id: uuid.UUID
    state: dict[str, Any]
    version: int  # 0: nothing stored yet
    updated_at: datetime | None


async def controller_state(session: AsyncSession, principal: Principal, instance_id: uuid.UUID) -> ControllerStateView:
    await controller_instance(session, principal, instance_id)
    row = (
        await session.execute(select(controller_states).where(controller_states.c.instance_id == instance_id))
    ).first()
    if row is None:
        return ControllerStateView(instance_id, {}, 0, None)
    return ControllerStateView(instance_id, dict(row.state), row.version, row.updated_at)


async def put_controller_state(
    session: AsyncSession,
    principal: Principal,
    instance_id: uuid.UUID,
    state: dict[str, Any],
    *,
    expected_version: int,
) -> ControllerStateView:
    """Compare-and-set: the instance row lock serialises writers, so of two that read version n one wins."""
    await controller_instance(session, principal, instance_id, lock=True)
    current = (
        await session.execute(select(controller_states.c.version).where(controller_states.c.instance_id == instance_id))
    ).scalar_one_or_none() or 0
    size = len(json.dumps(state, separators=(",", ":")).encode())
    version = check_controller_state_write(current, expected_version, size)
    at = now()
    values = {"state": state, "version": version, "updated_by": principal.actor.id, "updated_at": at}
    stmt = insert(controller_states).values(instance_id=instance_id, **values)
    await session.execute(stmt.on_conflict_do_update(index_elements=[controller_states.c.instance_id], set_=values))
    return ControllerStateView(instance_id, state, version, at)
