"""Loading and creating instance records shared by deploy, launch and lifecycle (kept apart from common.py,
which the operations and member rules use)."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime.models import allocations, instances, manifests
from gpuaas.app_runtime.service.common import emit_instance
from gpuaas.app_runtime.service.views import InstanceView, ManifestView, from_row
from gpuaas.contracts import Actor
from gpuaas.contracts.enums import AllocationStatus, InstanceStatus
from gpuaas.contracts.events import app_runtime as app_runtime_events
from gpuaas.contracts.events.app_runtime import InstanceHealth


async def load_manifest(session: AsyncSession, manifest_id: uuid.UUID | None) -> ManifestView:
    return from_row(
        ManifestView, (await session.execute(select(manifests).where(manifests.c.manifest_id == manifest_id))).one()
    )


async def create_instance(
    session: AsyncSession,
    *,
    instance_id: uuid.UUID,
    tenant_id: uuid.UUID,
    project_id: uuid.UUID,
    name: str,
    manifest: ManifestView,
    placement_intent: dict[str, Any],
    config: dict[str, Any],
    runtime_detail: dict[str, Any],
    actor: Actor,
) -> InstanceView:
    """A new instance of `manifest` (status created, health unknown) and its `instance.created` event."""
    row = (
        await session.execute(
            insert(instances)
            .values(
                instance_id=instance_id,
                tenant_id=tenant_id,
                project_id=project_id,
                name=name,
                app_slug=manifest.slug,
                app_version=manifest.app_version,
                manifest_id=manifest.manifest_id,
                artifact_digest=manifest.digest,
                status=InstanceStatus.created,
                placement_intent=placement_intent,
                config=config,
                runtime_detail=runtime_detail,
                health=InstanceHealth().model_dump(mode="json"),
                version=1,
            )
            .returning(*instances.c)
        )
    ).one()
    inst = from_row(InstanceView, row)
    await emit_instance(session, inst, app_runtime_events.InstanceCreated, actor)
    return inst


async def allocation_gone(session: AsyncSession, allocation_id: uuid.UUID) -> bool:
    """The launch allocation is released or failed (as projected here): a decommission can complete."""
    status = (
        await session.execute(select(allocations.c.status).where(allocations.c.allocation_id == allocation_id))
    ).scalar()
    return status in (AllocationStatus.released, AllocationStatus.failed)
