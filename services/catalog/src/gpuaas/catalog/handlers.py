"""Catalog's consumers: the projection of which artifact digest each app instance runs.

Fed by app-runtime's `instance.*` events (full state each); last writer wins by the instance's
`version`, so a redelivered or reordered older event never overwrites newer state.
"""

from __future__ import annotations

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.catalog.models import instance_digests
from gpuaas.contracts.events import app_runtime as ar
from gpuaas.kit.subscriptions import Subscriptions

subscriptions = Subscriptions()

INSTANCE_EVENTS = tuple(e for e in ar.EVENTS if e.event_type().startswith("instance."))


@subscriptions.on(*INSTANCE_EVENTS)
async def project_instance_digest(session: AsyncSession, event: ar.InstanceCreated) -> None:
    d = event.data
    values = {
        "instance_id": d.instance_id,
        "tenant_id": d.tenant_id,
        "manifest_id": d.manifest_id,
        "artifact_digest": d.artifact_digest,
        "status": str(d.status),
        "source_version": d.version,
        "updated_at": event.time,
    }
    stmt = pg_insert(instance_digests).values(values)
    stmt = stmt.on_conflict_do_update(
        index_elements=["instance_id"],
        set_={k: stmt.excluded[k] for k in values if k != "instance_id"},
        where=instance_digests.c.source_version <= stmt.excluded.source_version,
    )
    await session.execute(stmt)
