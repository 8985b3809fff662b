"""App-runtime's consumers: projections of allocations and catalog, the release saga, and preemption notices
(drains of the members on a preempted allocation).

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
from gpuaas.app_runtime.service import launch
from gpuaas.contracts.events import allocations as allocations_events
from gpuaas.contracts.events import catalog as catalog_events
from gpuaas.kit.subscriptions import Subscriptions

subscriptions = Subscriptions()

ALLOCATION_EVENTS = tuple(
    e for e in allocations_events.EVENTS if e.payload_model() is allocations_events.AllocationState
)


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
    state: allocations_events.AllocationState = event.data
    applied = await _upsert(
        session,
        allocations,
        "allocation_id",
        "version",
        {
            "allocation_id": state.allocation_id,
            "tenant_id": state.tenant_id,
            "project_id": state.project_id,
            "status": str(state.status),
            "shape": str(state.shape),
            "gpu_model": state.gpu_model,
            "gpu_count": state.gpu_count,
            "host_id": state.host_id,
            "version": state.version,
            "state": state.model_dump(mode="json"),
            "updated_at": event.time,
        },
    )
    if applied and event.type == allocations_events.AllocationReleaseRequested.event_type():
        await service.allocation_release_requested(session, state.allocation_id, state.tenant_id, state.project_id)
    if (
        applied
        and event.type == allocations_events.AllocationPreemptionScheduled.event_type()
        and state.preemption is not None
    ):  # the members on it are drained before the deadline
        await service.allocation_preemption_scheduled(session, state.allocation_id, state.preemption)
    if applied and state.workload is not None:  # a launchable instance follows its allocation
        await launch.allocation_changed(session, state, event.actor)


@subscriptions.on(catalog_events.AppRegistered, catalog_events.AppUpdated, catalog_events.AppDeprecated)
async def manifest_changed(session: AsyncSession, event: Any) -> None:
    manifest: catalog_events.AppManifestState = event.data
    deprecated = manifest.deprecated or event.type == catalog_events.AppDeprecated.event_type()
    await _upsert(
        session,
        manifests,
        "manifest_id",
        "revision",
        {
            "manifest_id": manifest.manifest_id,
            "slug": manifest.slug,
            "app_version": manifest.version,
            "active": manifest.active,
            "deprecated": deprecated,
            "artifact_ref": manifest.artifact_ref,
            "revision": manifest.revision,
            "state": manifest.model_dump(mode="json"),
            "updated_at": event.time,
        },
    )


@subscriptions.on(catalog_events.EntitlementGranted, catalog_events.EntitlementRevoked)
async def entitlement_changed(session: AsyncSession, event: Any) -> None:
    entitlement: catalog_events.EntitlementState = event.data
    status = "revoked" if event.type == catalog_events.EntitlementRevoked.event_type() else entitlement.status
    await _upsert(
        session,
        entitlements,
        "entitlement_id",
        "version",
        {
            "entitlement_id": entitlement.entitlement_id,
            "tenant_id": entitlement.tenant_id,
            "app_slug": entitlement.app_slug,
            "status": status,
            "version": entitlement.version,
            "updated_at": event.time,
        },
    )
