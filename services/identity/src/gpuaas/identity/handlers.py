"""Identity's consumers: the audit store (every service's `audit.recorded` events)."""

from __future__ import annotations

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts.events.audit import AuditRecorded
from gpuaas.identity.models import audit_records
from gpuaas.kit.subscriptions import Subscriptions

subscriptions = Subscriptions()


@subscriptions.on(AuditRecorded)
async def store_audit_record(session: AsyncSession, event: AuditRecorded) -> None:
    d = event.data
    await session.execute(
        insert(audit_records).values(
            event_id=event.id,
            occurred_at=event.time,
            service=d.service,
            actor_kind=str(event.actor.kind),
            actor_id=event.actor.id,
            tenant_id=event.tenant_id,
            project_id=event.project_id,
            action=d.action,
            resource_type=d.resource_type,
            resource_id=d.resource_id,
            outcome=d.outcome,
            before=d.before,
            after=d.after,
            reason=d.reason,
            correlation_id=event.correlation_id,
        )
    )
