"""What every identity use case shares: emitting an event (outbox + identity's own IAM projection), a
change's event together with its audit record, and the actor a system-initiated change is recorded under."""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Actor, Event
from gpuaas.identity import SERVICE
from gpuaas.kit import audit, iam, revocation
from gpuaas.kit.auth import Principal
from gpuaas.kit.outbox import add_event


async def emit(session: AsyncSession, event: Event) -> None:
    """Outbox the event and apply it to identity's own IAM projection and deny list in the same
    transaction, so identity's authorization decisions never lag behind its own writes (a revoked
    session or disabled account is refused by identity as soon as the change commits)."""
    await add_event(session, event)
    await iam.apply_locally(session, event)
    await revocation.apply_locally(session, event)


async def record_change(
    session: AsyncSession,
    event_cls: type[Event],
    state: BaseModel,
    *,
    actor: Actor,
    action: str,
    resource_type: str,
    resource_id: uuid.UUID,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    **scope: uuid.UUID | None,
) -> None:
    """Emit `event_cls` carrying the new `state` and record the change's audit entry (`after`: the state
    unless given), both under the `tenant_id=`/`project_id=` scope the caller names."""
    await emit(session, event_cls.build(subject=resource_id, data=state, source=SERVICE, actor=actor, **scope))
    await audit.record(
        session,
        service=SERVICE,
        actor=actor,
        action=action,
        resource_type=resource_type,
        resource_id=resource_id,
        before=before,
        after=state.model_dump(mode="json") if after is None else after,
        tenant_id=scope.get("tenant_id"),
        project_id=scope.get("project_id"),
    )


def actor_of(principal: Principal | None) -> Actor:
    return principal.actor if principal else Actor.system("identity-bootstrap")
