"""Identity's consumers: the audit store (every service's `audit.recorded` events).

Audit is the highest-volume event type: a consumed batch is stored set-based, in one fixed-shape statement
(`kit.bulk.insert_rows`, unnest of arrays), not one INSERT per event.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts.events.audit import AuditRecorded
from gpuaas.identity.models import audit_records
from gpuaas.kit.bulk import insert_rows
from gpuaas.kit.subscriptions import Subscriptions

subscriptions = Subscriptions()


def audit_row(event: AuditRecorded) -> dict[str, object]:
    d = event.data
    return {
        "event_id": event.id,
        "occurred_at": event.time,
        "service": d.service,
        "actor_kind": str(event.actor.kind),
        "actor_id": event.actor.id,
        "tenant_id": event.tenant_id,
        "project_id": event.project_id,
        "action": d.action,
        "resource_type": d.resource_type,
        "resource_id": d.resource_id,
        "outcome": d.outcome,
        "before": d.before,
        "after": d.after,
        "reason": d.reason,
        "correlation_id": event.correlation_id,
    }


@subscriptions.on_batch(AuditRecorded)
async def store_audit_records(session: AsyncSession, events: Sequence[AuditRecorded]) -> None:
    """Every audit record of the batch in one statement (the consumer hands each event once)."""
    await insert_rows(session, audit_records, [audit_row(e) for e in events])
