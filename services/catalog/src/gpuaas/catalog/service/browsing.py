"""Reading the catalog: whose view a caller reads, the apps and versions offered to a tenant, one
manifest, a compatibility verdict, and the snapshot pages that bootstrap projections."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, Literal

from sqlalchemy import Row, Table, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.catalog import domain
from gpuaas.catalog.models import artifacts, entitlements, manifests
from gpuaas.catalog.service.common import (
    artifact_state,
    entitlement_state,
    manifest_state,
    manifest_view,
    manifests_with_artifacts,
)
from gpuaas.catalog.service.entitlements import entitled_slugs
from gpuaas.catalog.service.views import CompatibilityVerdict, Manifest, SnapshotPage
from gpuaas.contracts.enums import MembershipScope
from gpuaas.contracts.envelope import Payload
from gpuaas.contracts.events.catalog import ArtifactLifecycle
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import NotFound, Unprocessable
from gpuaas.kit.tables import iam_memberships, iam_users


async def reader_tenant(
    session: AsyncSession, principal: Principal, tenant_id: uuid.UUID | None
) -> tuple[uuid.UUID | None, bool]:
    """(tenant whose view to serve, is operator). Operators may omit the tenant (everything);
    others read as a tenant they belong to; a tenant they do not belong to is 404."""
    if principal.is_service_account:
        if principal.project_id is None:
            raise NotFound("not found", code="not_found")
        await iam.authorize(session, principal, "catalog.app.read", project_id=principal.project_id)
        owner = await iam.project_tenant(session, principal.project_id)
        if tenant_id is not None and tenant_id != owner:
            raise NotFound("tenant not found", code="tenant_not_found")
        return owner, False
    if await iam.is_platform_admin(session, principal):
        return tenant_id, True
    tid = tenant_id or principal.tenant_id
    if tid is None:
        raise Unprocessable("pass the tenant_id whose catalog you want to see", code="tenant_required")
    user = (await session.execute(select(iam_users.c.status).where(iam_users.c.user_id == principal.subject))).first()
    member = (
        await session.execute(
            select(iam_memberships.c.membership_id).where(
                iam_memberships.c.user_id == principal.subject,
                iam_memberships.c.tenant_id == tid,
                iam_memberships.c.revoked.is_(False),
                iam_memberships.c.scope.in_([MembershipScope.tenant.value, MembershipScope.project.value]),
            )
        )
    ).first()
    if member is None or (user is not None and user.status != "active"):
        raise NotFound("tenant not found", code="tenant_not_found")
    return tid, False


async def list_apps(
    session: AsyncSession, tenant_id: uuid.UUID | None, operator: bool, slug: str | None = None
) -> list[Manifest]:
    """Operators without a tenant see every manifest; a tenant sees the versions offered to it of
    the apps it is entitled to (active ones, plus canaries exposed to it)."""
    where = [manifests.c.slug == slug] if slug else []
    rows = await manifests_with_artifacts(session, where)
    if operator and tenant_id is None:
        return [manifest_view(row, artifact["state"]) for row, artifact in rows]
    assert tenant_id is not None
    entitled = await entitled_slugs(session, tenant_id)
    return [
        manifest_view(row, artifact["state"], canary=artifact["state"] == ArtifactLifecycle.canary.value)
        for row, artifact in rows
        if row.slug in entitled and domain.offered_to(dict(row._mapping), artifact, tenant_id) is None
    ]


async def get_manifest(
    session: AsyncSession, manifest_id: uuid.UUID, tenant_id: uuid.UUID | None, operator: bool
) -> Manifest:
    rows = await manifests_with_artifacts(session, [manifests.c.manifest_id == manifest_id])
    if not rows:
        raise NotFound("app manifest not found", code="manifest_not_found")
    row, artifact = rows[0]
    if not (operator and tenant_id is None):
        assert tenant_id is not None
        # Tenants see what is offered to them, and deprecated versions of apps they are entitled to
        # (their existing instances still run them).
        if row.slug not in await entitled_slugs(session, tenant_id) or domain.offered_to(
            dict(row._mapping), artifact, tenant_id
        ) not in (None, "manifest_deprecated"):
            raise NotFound("app manifest not found", code="manifest_not_found")
    return manifest_view(row, artifact["state"])


async def check_compatibility(
    session: AsyncSession,
    *,
    slug: str,
    version: str | None,
    tenant_id: uuid.UUID | None,
    shape: domain.AllocationShape,
) -> CompatibilityVerdict:
    where = [manifests.c.slug == slug] + ([manifests.c.version == version] if version else [])
    rows = await manifests_with_artifacts(session, where)
    if tenant_id is not None and slug not in await entitled_slugs(session, tenant_id):
        rows = []  # not entitled: the app does not exist for this tenant
    if not rows:
        raise NotFound(f"no app {slug!r}" + (f" version {version}" if version else ""), code="app_not_found")
    candidates = rows
    if version is None and tenant_id is not None:
        offered = [(r, a) for r, a in rows if domain.offered_to(dict(r._mapping), a, tenant_id) is None]
        candidates = offered or rows
    row, artifact = candidates[-1]  # newest registered
    m = dict(row._mapping)
    reasons = domain.compatibility_reasons(m["compatibility"], shape)
    not_offered = (
        domain.offered_to(m, artifact, tenant_id)
        if tenant_id is not None
        else ("manifest_deprecated" if m["deprecated"] else None if m["active"] else "manifest_not_active")
    )
    deploy_reasons = [{"code": not_offered, "message": domain.NOT_OFFERED_MESSAGES[not_offered]}] if not_offered else []
    return CompatibilityVerdict.model_validate(
        {
            "manifest_id": m["manifest_id"],
            "slug": m["slug"],
            "version": m["version"],
            "runtime_version": m["runtime_version"],
            "compatible": not reasons,
            "deployable": not reasons and not deploy_reasons,
            "reasons": reasons + deploy_reasons,
        }
    )


async def snapshot(
    session: AsyncSession,
    entity: Literal["manifests", "artifacts", "entitlements"],
    after: uuid.UUID | None,
    limit: int,
) -> SnapshotPage:
    """Full states in key order, `limit` at a time after `after`."""
    table, key_name, to_state = _SNAPSHOTS[entity]
    key = table.c[key_name]
    query = select(table).order_by(key).limit(limit)
    if after is not None:
        query = query.where(key > after)
    rows = (await session.execute(query)).all()
    return SnapshotPage([to_state(row) for row in rows], getattr(rows[-1], key_name) if len(rows) == limit else None)


_SNAPSHOTS: dict[str, tuple[Table, str, Callable[[Row[Any]], Payload]]] = {
    "manifests": (manifests, "manifest_id", manifest_state),
    "artifacts": (artifacts, "artifact_id", artifact_state),
    "entitlements": (entitlements, "entitlement_id", entitlement_state),
}
