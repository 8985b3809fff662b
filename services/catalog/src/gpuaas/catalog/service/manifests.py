"""App manifest use cases: register a version, offer or withdraw it (activate, deactivate),
deprecate it. Each runs in the caller's one transaction."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.catalog import domain
from gpuaas.catalog.models import artifacts, manifests
from gpuaas.catalog.oci import TrustError, parse_ref
from gpuaas.catalog.service.common import (
    current_manifest_view,
    manifest_for_update,
    manifest_state,
    publish,
    row_of,
    trust_problem,
)
from gpuaas.catalog.service.views import Manifest
from gpuaas.contracts import new_event_id
from gpuaas.contracts.events import catalog as catalog_events
from gpuaas.contracts.events.catalog import AppArtifactKind, ArtifactLifecycle
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, Unprocessable
from gpuaas.kit.versioning import check_version


async def register_manifest(session: AsyncSession, principal: Principal, doc: dict[str, Any]) -> Manifest:
    """Register an app version: its `artifact_ref` must name a registered, not retired artifact of the
    app's kind (an active version an active artifact)."""
    ref = doc.get("artifact_ref")
    if isinstance(ref, str):  # a tag or a malformed reference is refused before anything else
        try:
            parse_ref(ref)
        except TrustError as exc:
            raise trust_problem(exc) from None
    await iam.authorize(session, principal, "catalog.app.register")
    m = domain.validate_manifest(doc)
    art = (await session.execute(select(artifacts).where(artifacts.c.ref == m["artifact_ref"]))).first()
    if art is None:
        raise Unprocessable(
            f"{m['artifact_ref']} is not a registered artifact; register (and verify) it first",
            code="artifact_not_registered",
        )
    app_kind = AppArtifactKind(m["artifact_kind"])
    if art.kind != domain.artifact_kind_for(app_kind).value:
        raise Unprocessable(
            f"a {app_kind.value} app needs an {domain.artifact_kind_for(app_kind).value} artifact, not {art.kind}",
            code="artifact_kind_mismatch",
        )
    if art.state == ArtifactLifecycle.retired.value:
        raise Conflict("the artifact is retired", code="artifact_retired")
    if m["active"] and art.state != ArtifactLifecycle.active.value:
        raise Conflict(
            f"an active manifest cannot reference a {art.state} artifact; promote the artifact to active first",
            code="artifact_not_active",
        )
    taken = await session.execute(
        select(manifests.c.manifest_id).where(manifests.c.slug == m["slug"], manifests.c.version == m["version"])
    )
    if taken.first():
        raise Conflict(f"{m['slug']} {m['version']} is already registered", code="manifest_version_exists")
    manifest_id = new_event_id()
    await session.execute(
        insert(manifests).values(
            manifest_id=manifest_id,
            slug=m["slug"],
            version=m["version"],
            runtime_version=m["runtime_version"],
            display_name=m["display_name"],
            description=m["description"],
            artifact_kind=app_kind.value,
            artifact_ref=m["artifact_ref"],
            artifact_id=art.artifact_id,
            compatibility=m["compatibility"],
            runtime_profile=m["runtime_profile"],
            inputs=m["inputs"],
            roles=m["roles"],
            active=m["active"],
        )
    )
    state = manifest_state(await row_of(session, manifests, "manifest_id", manifest_id))
    await publish(
        session,
        principal,
        catalog_events.AppRegistered,
        state,
        action="catalog.app.register",
        resource_type="app_manifest",
        resource_id=manifest_id,
        after=state.model_dump(mode="json"),
    )
    return await current_manifest_view(session, manifest_id)


async def set_manifest_active(
    session: AsyncSession,
    principal: Principal,
    manifest_id: uuid.UUID,
    *,
    active: bool,
    reason: str,
    expected_version: int | None,
) -> Manifest:
    """Offer the version to entitled tenants (only while its artifact is active), or withdraw it.
    The manifest's change counter is its `revision`: that is what If-Match names."""
    await iam.authorize(session, principal, "catalog.app.register")
    row = await manifest_for_update(session, manifest_id)
    check_version(row.revision, expected_version)
    if active:
        if row.deprecated:
            raise Conflict("a deprecated manifest cannot be activated again", code="manifest_deprecated")
        art = (await session.execute(select(artifacts.c.state).where(artifacts.c.artifact_id == row.artifact_id))).one()
        if art.state != ArtifactLifecycle.active.value:
            raise Conflict(
                f"an active manifest cannot reference a {art.state} artifact; promote the artifact first",
                code="artifact_not_active",
            )
    if row.active != active:
        await session.execute(
            update(manifests)
            .where(manifests.c.manifest_id == manifest_id)
            .values(active=active, revision=row.revision + 1, updated_at=func.now())
        )
        await publish(
            session,
            principal,
            catalog_events.AppUpdated,
            manifest_state(await row_of(session, manifests, "manifest_id", manifest_id)),
            action="catalog.app.activate" if active else "catalog.app.deactivate",
            resource_type="app_manifest",
            resource_id=manifest_id,
            before={"active": row.active},
            after={"active": active},
            reason=reason or None,
        )
    return await current_manifest_view(session, manifest_id)


async def deprecate_manifest_unchecked(
    session: AsyncSession, principal: Principal, manifest_id: uuid.UUID, reason: str
) -> None:
    """Deprecate without an authorization check of its own: for callers that already made one (an
    operator's request, or the deprecation of the manifest's artifact)."""
    row = await manifest_for_update(session, manifest_id)
    if row.deprecated:
        return
    await session.execute(
        update(manifests)
        .where(manifests.c.manifest_id == manifest_id)
        .values(active=False, deprecated=True, revision=row.revision + 1, updated_at=func.now())
    )
    await publish(
        session,
        principal,
        catalog_events.AppDeprecated,
        manifest_state(await row_of(session, manifests, "manifest_id", manifest_id)),
        action="catalog.app.deprecate",
        resource_type="app_manifest",
        resource_id=manifest_id,
        before={"active": row.active, "deprecated": False},
        after={"active": False, "deprecated": True},
        reason=reason,
    )


async def deprecate_manifest(
    session: AsyncSession, principal: Principal, manifest_id: uuid.UUID, *, reason: str
) -> Manifest:
    """Existing instances continue; no new instance may use this version."""
    await iam.authorize(session, principal, "catalog.app.register")
    await deprecate_manifest_unchecked(session, principal, manifest_id, reason)
    return await current_manifest_view(session, manifest_id)
