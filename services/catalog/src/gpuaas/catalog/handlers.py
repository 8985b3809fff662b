"""Catalog's consumers: the projection of which artifact digest each app instance runs.

Fed by app-runtime's `instance.*` events (full state each); last writer wins by the instance's
`version`, so a redelivered or reordered older event never overwrites newer state.
"""

from __future__ import annotations

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.catalog.models import instance_digests
from gpuaas.contracts.events import app_runtime as app_runtime_events
from gpuaas.kit.subscriptions import Subscriptions

subscriptions = Subscriptions()

INSTANCE_EVENTS = tuple(e for e in app_runtime_events.EVENTS if e.event_type().startswith("instance."))


@subscriptions.on(*INSTANCE_EVENTS)
async def project_instance_digest(session: AsyncSession, event: app_runtime_events.InstanceCreated) -> None:
    data = event.data
    values = {
        "instance_id": data.instance_id,
        "tenant_id": data.tenant_id,
        "manifest_id": data.manifest_id,
        "artifact_digest": data.artifact_digest,
        "status": str(data.status),
        "source_version": data.version,
        "updated_at": event.time,
    }
    stmt = pg_insert(instance_digests).values(values)
    stmt = stmt.on_conflict_do_update(
        index_elements=["instance_id"],
        set_={k: stmt.excluded[k] for k in values if k != "instance_id"},
        where=instance_digests.c.source_version <= stmt.excluded.source_version,
    )
    await session.execute(stmt)
