"""Deploying apps: the controller binding of an app in a project, choosing and checking a manifest
(entitlement, state, placement, compatibility, inputs), the deploy itself and later version changes
(upgrade, rollback)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime import domain
from gpuaas.app_runtime.models import allocations, controller_bindings, entitlements, manifests
from gpuaas.app_runtime.service import launch
from gpuaas.app_runtime.service.common import (
    audit_on,
    authorized_instance,
    insert_operation,
    timeline,
    update_instance,
)
from gpuaas.app_runtime.service.credentials import insert_credential
from gpuaas.app_runtime.service.instance_records import create_instance, load_manifest
from gpuaas.app_runtime.service.views import (
    ControllerBindingView,
    InstanceView,
    IssuedCredential,
    ManifestView,
    from_row,
)
from gpuaas.contracts import new_event_id
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events.app_runtime import OperationKind, PlacementIntent
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, Forbidden, NotFound, Unprocessable
from gpuaas.kit.tables import iam_service_accounts
from gpuaas.kit.versioning import check_version

# ------------------------------------------------------------------------------------------ controller bindings


async def bind_controller(
    session: AsyncSession, principal: Principal, project_id: uuid.UUID, app_slug: str, service_account_id: uuid.UUID
) -> ControllerBindingView:
    """Make a service account (scope `app-controller`) the controller of an app in a project."""
    await iam.authorize(session, principal, "apps.instance.manage", project_id=project_id)
    known = (await session.execute(select(manifests.c.manifest_id).where(manifests.c.slug == app_slug))).first()
    if known is None:  # the catalog's manifests reach this projection by event: a new app may lag a moment
        raise NotFound(f"no app {app_slug!r} in the catalog (or not known to app-runtime yet)", code="app_not_found")
    sa = (
        await session.execute(
            select(iam_service_accounts).where(iam_service_accounts.c.service_account_id == service_account_id)
        )
    ).first()
    if sa is None or sa.project_id != project_id or sa.disabled:
        raise Unprocessable("no active service account with this id in this project", code="service_account_invalid")
    if "app-controller" not in (sa.scopes or []):
        raise Unprocessable("the service account lacks the app-controller scope", code="service_account_invalid")
    tenant_id = await iam.project_tenant(session, project_id)
    before = (
        await session.execute(
            select(controller_bindings.c.service_account_id).where(
                controller_bindings.c.project_id == project_id, controller_bindings.c.app_slug == app_slug
            )
        )
    ).scalar()
    stmt = pg_insert(controller_bindings).values(
        binding_id=new_event_id(),
        tenant_id=tenant_id,
        project_id=project_id,
        app_slug=app_slug,
        service_account_id=service_account_id,
    )
    stmt = stmt.on_conflict_do_update(
        constraint="uq_controller_bindings_project_app", set_={"service_account_id": service_account_id}
    ).returning(*controller_bindings.c)
    binding = from_row(ControllerBindingView, (await session.execute(stmt)).one())
    await audit_on(
        session,
        principal,
        "apps.controller.bind",
        binding,
        before={"service_account_id": str(before)} if before else None,
        after={"app_slug": app_slug, "service_account_id": str(service_account_id)},
    )
    return binding


# ------------------------------------------------------------------------------------------ manifests


async def find_manifest(session: AsyncSession, app_slug: str, app_version: str | None) -> ManifestView:
    """The manifest of a version of an app; without a version, its latest active one."""
    stmt = select(manifests).where(manifests.c.slug == app_slug)
    if app_version is not None:
        stmt = stmt.where(manifests.c.app_version == app_version)
    else:
        stmt = stmt.where(manifests.c.active.is_(True), manifests.c.deprecated.is_(False))
    found = [from_row(ManifestView, r) for r in await session.execute(stmt)]
    if not found:
        what = f"{app_slug} {app_version}" if app_version else f"an active version of {app_slug}"
        raise NotFound(f"no app manifest for {what}", code="app_not_found")
    return max(found, key=lambda m: domain.version_key(m.app_version))


def compatibility_of(manifest: ManifestView) -> dict[str, Any]:
    return manifest.state.get("compatibility") or {}


async def check_deployable(session: AsyncSession, tenant_id: uuid.UUID, manifest: ManifestView) -> None:
    entitled = (
        await session.execute(
            select(entitlements.c.entitlement_id).where(
                entitlements.c.tenant_id == tenant_id,
                entitlements.c.app_slug == manifest.slug,
                entitlements.c.status == "granted",
            )
        )
    ).first()
    if entitled is None:
        raise Forbidden(f"this tenant is not entitled to {manifest.slug}", code="app_not_entitled")
    if manifest.deprecated:
        raise Conflict(
            f"{manifest.slug} {manifest.app_version} is deprecated; choose a newer version", code="app_deprecated"
        )
    if not manifest.active:
        raise Conflict(f"{manifest.slug} {manifest.app_version} is not active", code="app_not_active")


async def allocation_views(session: AsyncSession, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, domain.AllocationView]:
    rows = await session.execute(select(allocations).where(allocations.c.allocation_id.in_(list(ids))))
    return {
        r.allocation_id: domain.AllocationView(r.allocation_id, r.project_id, r.status, r.shape, r.gpu_count)
        for r in rows
    }


# ------------------------------------------------------------------------------------------ deploy


async def authorize_deploy(session: AsyncSession, principal: Principal, project_id: uuid.UUID) -> None:
    """Refuse a deploy the caller may not do before a key is made for it."""
    await iam.authorize(session, principal, "apps.instance.deploy", project_id=project_id)


async def deploy(
    session: AsyncSession,
    principal: Principal,
    project_id: uuid.UUID,
    *,
    name: str,
    app_slug: str,
    app_version: str | None,
    config: dict[str, Any],
    placement: PlacementIntent,
    credential: IssuedCredential,
) -> InstanceView:
    """A new instance: one `add` operation per member of the placement, and its access credential."""
    await iam.authorize(session, principal, "apps.instance.deploy", project_id=project_id)
    tenant_id = await iam.project_tenant(session, project_id)
    assert tenant_id is not None
    manifest = await find_manifest(session, app_slug, app_version)
    await check_deployable(session, tenant_id, manifest)
    if launch.is_launchable(manifest):  # its own allocation, no controller (service/launch.py)
        return await launch.deploy_launchable(
            session,
            principal,
            tenant_id=tenant_id,
            project_id=project_id,
            name=name,
            manifest=manifest,
            config=config,
            placement=placement,
        )
    ids = [i for i in [placement.controller_allocation_id, *placement.worker_allocation_ids] if i is not None]
    domain.check_placement(
        project_id=project_id,
        mode=placement.mode,
        controller_allocation_id=placement.controller_allocation_id,
        worker_allocation_ids=placement.worker_allocation_ids,
        allocations=await allocation_views(session, ids),
        compatibility=compatibility_of(manifest),
    )
    domain.validate_config(manifest.state.get("inputs") or {"type": "object"}, config)
    actor = principal.actor
    inst = await create_instance(
        session,
        instance_id=new_event_id(),
        tenant_id=tenant_id,
        project_id=project_id,
        name=name,
        manifest=manifest,
        placement_intent=placement.model_dump(mode="json"),
        config=config,
        runtime_detail={},
        actor=actor,
    )
    await timeline(
        session, inst.instance_id, "instance.created", f"deployed {manifest.slug} {manifest.app_version}", actor
    )
    controller_key, worker_key = domain.component_keys(manifest.state.get("roles") or [])
    await insert_operation(
        session,
        inst,
        OperationKind.add,
        actor,
        allocation_id=placement.controller_allocation_id,
        component_key=controller_key,
    )
    for worker in placement.worker_allocation_ids:
        await insert_operation(session, inst, OperationKind.add, actor, allocation_id=worker, component_key=worker_key)
    cred = await insert_credential(session, inst, credential, sorted({str(i) for i in ids}), actor=actor)
    await timeline(
        session,
        inst.instance_id,
        "credential.issued",
        f"access credential {cred.fingerprint} issued",
        actor,
        credential_id=cred.credential_id,
    )
    await audit_on(
        session,
        principal,
        "apps.instance.deploy",
        inst,
        after={
            "app": manifest.slug,
            "version": manifest.app_version,
            "placement": placement.model_dump(mode="json"),
            "credential_fingerprint": cred.fingerprint,
        },
    )
    return inst


# ------------------------------------------------------------------------------------------ version changes


async def upgrade(
    session: AsyncSession,
    principal: Principal,
    instance_id: uuid.UUID,
    app_version: str | None,
    *,
    rollback: bool = False,
    expected_version: int | None = None,
) -> InstanceView:
    """Ask the controller to roll out another version (`desired_*`); `rollback` targets the previous one."""
    inst = await authorized_instance(session, principal, instance_id, "apps.instance.manage")
    check_version(inst.version, expected_version)
    if inst.status not in domain.LIVE_INSTANCE and inst.status != InstanceStatus.stopped:
        raise Conflict(f"an instance that is {inst.status} cannot change version", code="instance_not_live")
    if rollback:
        if inst.previous_manifest_id is None:
            raise Conflict("there is no previous version to roll back to", code="no_previous_version")
        target = await load_manifest(session, inst.previous_manifest_id)
    else:
        if not app_version:
            raise Unprocessable("app_version is required", code="validation_error")
        target = await find_manifest(session, inst.app_slug, app_version)
    if target.manifest_id == inst.manifest_id:
        raise Conflict(f"the instance already runs {target.app_version}", code="version_unchanged")
    await check_deployable(session, inst.tenant_id, target)
    domain.validate_config(target.state.get("inputs") or {"type": "object"}, inst.config)
    actor = principal.actor
    inst = await update_instance(
        session, instance_id, actor, desired_manifest_id=target.manifest_id, desired_app_version=target.app_version
    )
    verb = "rollback" if rollback else "upgrade"
    await timeline(
        session,
        instance_id,
        f"instance.{verb}",
        f"{verb} to {target.app_version} requested",
        actor,
        from_version=inst.app_version,
        to_version=target.app_version,
    )
    await audit_on(
        session,
        principal,
        f"apps.instance.{verb}",
        inst,
        before={"app_version": inst.app_version},
        after={"desired_app_version": target.app_version},
    )
    return inst
