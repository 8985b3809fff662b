"""Audit emitter: every mutation records who did what to which resource, in the same transaction.

Records travel on `gpuaas.audit.v1` through the outbox; identity stores them and serves `GET /audit`.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Actor
from gpuaas.contracts.events.audit import AuditRecord, AuditRecorded
from gpuaas.kit.auth import Principal
from gpuaas.kit.outbox import add_event


async def record(
    session: AsyncSession,
    *,
    service: str,
    actor: Principal | Actor,
    action: str,
    resource_type: str,
    resource_id: Any,
    tenant_id: uuid.UUID | None = None,
    project_id: uuid.UUID | None = None,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    reason: str | None = None,
    outcome: Literal["succeeded", "denied", "failed"] = "succeeded",
) -> AuditRecorded:
    event = AuditRecorded.build(
        subject=resource_id,
        source=service,
        actor=actor.actor if isinstance(actor, Principal) else actor,
        tenant_id=tenant_id,
        project_id=project_id,
        data=AuditRecord(
            service=service,
            action=action,
            resource_type=resource_type,
            resource_id=str(resource_id),
            before=before,
            after=after,
            reason=reason,
            outcome=outcome,
        ),
    )
    await add_event(session, event)
    return event
