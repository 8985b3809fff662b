"""What every identity use case shares: emitting an event (outbox + identity's own IAM projection)
and the actor a system-initiated change is recorded under."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Actor, Event
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.outbox import add_event


async def emit(session: AsyncSession, event: Event) -> None:
    """Outbox the event and apply it to identity's own IAM projection in the same transaction, so
    identity's authorization decisions never lag behind its own writes."""
    await add_event(session, event)
    await iam.apply_locally(session, event)


def actor_of(principal: Principal | None) -> Actor:
    return principal.actor if principal else Actor.system("identity-bootstrap")
