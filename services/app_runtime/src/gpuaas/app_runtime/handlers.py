"""App-runtime's consumers: projections of allocations and catalog, and the release saga.

Handlers run in the consumer's transaction with the inbox row; they never call out on the network.
Projections apply an event only if it is newer than what they hold (the entity's own counter), so a
replay or a late duplicate never rolls state back.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime import service
from gpuaas.app_runtime.models import allocations, entitlements, manifests
from gpuaas.contracts.events import allocations as alloc_ev
from gpuaas.contracts.events import catalog as cat_ev
from gpuaas.kit.subscriptions import Subscriptions

subscriptions = Subscriptions()

ALLOCATION_EVENTS = tuple(e for e in alloc_ev.EVENTS if e.payload_model() is alloc_ev.AllocationState)


async def _upsert(session: AsyncSession, table: Any, key: str, counter: str, values: dict[str, Any]) -> bool:
    stmt = pg_insert(table).values(values)
    stmt = stmt.on_conflict_do_update(
        index_elements=[key],
        set_={k: stmt.excluded[k] for k in values if k != key},
        where=getattr(table.c, counter) < getattr(stmt.excluded, counter),
    ).returning(getattr(table.c, key))
    return (await session.execute(stmt)).first() is not None


@subscriptions.on(*ALLOCATION_EVENTS)
async def allocation_changed(session: AsyncSession, event: Any) -> None:
    d: alloc_ev.AllocationState = event.data
    applied = await _upsert(
        session,
        allocations,
        "allocation_id",
        "version",
        {
            "allocation_id": d.allocation_id,
            "tenant_id": d.tenant_id,
            "project_id": d.project_id,
            "status": str(d.status),
            "shape": str(d.shape),
            "gpu_model": d.gpu_model,
            "gpu_count": d.gpu_count,
            "host_id": d.host_id,
            "version": d.version,
            "state": d.model_dump(mode="json"),
            "updated_at": event.time,
        },
    )
    if applied and event.type == alloc_ev.AllocationReleaseRequested.event_type():
        await service.allocation_release_requested(session, d.allocation_id, d.tenant_id, d.project_id)


@subscriptions.on(cat_ev.AppRegistered, cat_ev.AppUpdated, cat_ev.AppDeprecated)
async def manifest_changed(session: AsyncSession, event: Any) -> None:
    d: cat_ev.AppManifestState = event.data
    deprecated = d.deprecated or event.type == cat_ev.AppDeprecated.event_type()
    await _upsert(
        session,
        manifests,
        "manifest_id",
        "revision",
        {
            "manifest_id": d.manifest_id,
            "slug": d.slug,
            "app_version": d.version,
            "active": d.active,
            "deprecated": deprecated,
            "artifact_ref": d.artifact_ref,
            "revision": d.revision,
            "state": d.model_dump(mode="json"),
            "updated_at": event.time,
        },
    )


@subscriptions.on(cat_ev.EntitlementGranted, cat_ev.EntitlementRevoked)
async def entitlement_changed(session: AsyncSession, event: Any) -> None:
    d: cat_ev.EntitlementState = event.data
    status = "revoked" if event.type == cat_ev.EntitlementRevoked.event_type() else d.status
    await _upsert(
        session,
        entitlements,
        "entitlement_id",
        "version",
        {
            "entitlement_id": d.entitlement_id,
            "tenant_id": d.tenant_id,
            "app_slug": d.app_slug,
            "status": status,
            "version": d.version,
            "updated_at": event.time,
        },
    )
