"""Catalog use cases. Each is one transaction: state + outbox events + audit record commit together.

Registry work (content verification, signature checks) happens before the transaction opens, in
the API layer; the use cases here receive its results and never call the network.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.catalog import domain
from gpuaas.catalog.models import artifact_transitions, artifacts, entitlements, instance_digests, manifests
from gpuaas.catalog.oci import Reference, SignatureResult, Verified
from gpuaas.contracts import new_event_id
from gpuaas.contracts.enums import MembershipScope
from gpuaas.contracts.events import catalog as ev
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound, Unprocessable
from gpuaas.kit.outbox import add_event
from gpuaas.kit.tables import iam_memberships, iam_tenants, iam_users
from gpuaas.kit.versioning import check_version

SERVICE = "catalog"
L = ev.ArtifactLifecycle
# Instances in these states no longer hold their artifact digest (the retire gate).
RELEASED_INSTANCE_STATES = ("decommissioned",)


def _now() -> datetime:
    return datetime.now(UTC)


# ------------------------------------------------------------------------------------------ states


def artifact_state(row: Any) -> ev.ArtifactState:
    r = row._mapping if hasattr(row, "_mapping") else row
    return ev.ArtifactState(
        artifact_id=r["artifact_id"],
        kind=ev.ArtifactKind(r["kind"]),
        ref=r["ref"],
        digest=r["digest"],
        media_type=r["media_type"],
        size_bytes=r["size_bytes"],
        state=ev.ArtifactLifecycle(r["state"]),
        canary_tenants=[uuid.UUID(str(t)) for t in r["canary_tenants"]],
        checks=[ev.ArtifactCheck(**c) for c in r["checks"]],
        signature_verified=r["signature_verified"],
        version=r["version"],
    )


def manifest_state(row: Any) -> ev.AppManifestState:
    r = row._mapping if hasattr(row, "_mapping") else row
    return ev.AppManifestState(
        manifest_id=r["manifest_id"],
        slug=r["slug"],
        display_name=r["display_name"],
        description=r["description"],
        version=r["version"],
        runtime_version=r["runtime_version"],
        artifact_kind=ev.AppArtifactKind(r["artifact_kind"]),
        artifact_ref=r["artifact_ref"],
        artifact_id=r["artifact_id"],
        compatibility=ev.Compatibility(**r["compatibility"]),
        runtime_profile=r["runtime_profile"],
        inputs=r["inputs"],
        roles=[ev.AppRole(**x) for x in r["roles"]],
        active=r["active"],
        deprecated=r["deprecated"],
        revision=r["revision"],
    )


def entitlement_state(row: Any) -> ev.EntitlementState:
    r = row._mapping if hasattr(row, "_mapping") else row
    return ev.EntitlementState(
        entitlement_id=r["entitlement_id"],
        tenant_id=r["tenant_id"],
        app_slug=r["app_slug"],
        status=r["status"],
        granted_at=r["granted_at"],
        revoked_at=r["revoked_at"],
        version=r["version"],
    )


def artifact_view(row: Any) -> dict[str, Any]:
    r = dict(row._mapping)
    return {
        **artifact_state(row).model_dump(mode="json"),
        "registry": r["registry"],
        "repository": r["repository"],
        "artifact_type": r["artifact_type"],
        "signature_detail": r["signature_detail"],
        "created_at": r["created_at"],
        "updated_at": r["updated_at"],
    }


def manifest_view(row: Any) -> dict[str, Any]:
    r = dict(row._mapping)
    return {
        **manifest_state(row).model_dump(mode="json"),
        "created_at": r["created_at"],
        "updated_at": r["updated_at"],
    }


# ---------------------------------------------------------------------------------------- helpers


async def _artifact_for_update(session: AsyncSession, artifact_id: uuid.UUID) -> Any:
    row = (
        await session.execute(select(artifacts).where(artifacts.c.artifact_id == artifact_id).with_for_update())
    ).first()
    if row is None:
        raise NotFound("artifact not found", code="artifact_not_found")
    return row


async def _manifest_for_update(session: AsyncSession, manifest_id: uuid.UUID) -> Any:
    row = (
        await session.execute(select(manifests).where(manifests.c.manifest_id == manifest_id).with_for_update())
    ).first()
    if row is None:
        raise NotFound("app manifest not found", code="manifest_not_found")
    return row


async def instances_using(session: AsyncSession, digest: str) -> int:
    return (
        await session.execute(
            select(func.count())
            .select_from(instance_digests)
            .where(
                instance_digests.c.artifact_digest == digest,
                instance_digests.c.status.not_in(RELEASED_INSTANCE_STATES),
            )
        )
    ).scalar_one()


async def tenant_known(session: AsyncSession, tenant_id: uuid.UUID) -> bool:
    return (
        await session.execute(select(iam_tenants.c.tenant_id).where(iam_tenants.c.tenant_id == tenant_id))
    ).first() is not None


async def _require_tenants(session: AsyncSession, tenant_ids: list[uuid.UUID]) -> None:
    for t in tenant_ids:
        if not await tenant_known(session, t):
            raise Unprocessable(f"tenant {t} is unknown", code="tenant_unknown")


def _check_dict(name: str, passed: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "passed": passed, "recorded_at": _now().isoformat(), "detail": detail[:2000]}


def _with_check(checks: list[dict[str, Any]], check: dict[str, Any]) -> list[dict[str, Any]]:
    """Keep the latest result per check name (earlier ones stay in the audit trail)."""
    return [c for c in checks if c["name"] != check["name"]] + [check]


async def _history(
    session: AsyncSession,
    principal: Principal,
    artifact_id: uuid.UUID,
    from_state: str | None,
    to_state: str,
    reason: str,
    detail: dict[str, Any] | None = None,
) -> None:
    await session.execute(
        insert(artifact_transitions).values(
            transition_id=new_event_id(),
            artifact_id=artifact_id,
            from_state=from_state,
            to_state=to_state,
            actor_kind=str(principal.kind),
            actor_id=str(principal.subject),
            reason=reason,
            detail=detail or {},
        )
    )


# ---------------------------------------------------------------------------------------- artifacts


async def register_artifact(
    session: AsyncSession,
    principal: Principal,
    *,
    kind: ev.ArtifactKind,
    verified: Verified,
    signature: SignatureResult | None,
) -> dict[str, Any]:
    """Record a verified digest as a `draft` artifact (its content check recorded as passed)."""
    await iam.authorize(session, principal, "catalog.artifact.register")
    ref: Reference = verified.reference
    if (await session.execute(select(artifacts.c.artifact_id).where(artifacts.c.ref == ref.ref))).first():
        raise Conflict(f"{ref.ref} is already registered", code="artifact_already_registered")
    artifact_id = new_event_id()
    checks = [_check_dict("content", True, "; ".join(verified.detail))]
    if signature is not None:
        checks.append(_check_dict("signature", signature.verified, signature.detail))
    await session.execute(
        insert(artifacts).values(
            artifact_id=artifact_id,
            kind=kind.value,
            ref=ref.ref,
            registry=ref.registry,
            repository=ref.repository,
            digest=ref.digest,
            media_type=verified.media_type,
            artifact_type=verified.artifact_type,
            size_bytes=verified.size_bytes,
            state=L.draft.value,
            checks=checks,
            signature_verified=bool(signature and signature.verified),
            signature_detail=signature.detail if signature else None,
        )
    )
    await _history(session, principal, artifact_id, None, L.draft.value, "registered", {"ref": ref.ref})
    row = (await session.execute(select(artifacts).where(artifacts.c.artifact_id == artifact_id))).one()
    state = artifact_state(row)
    await add_event(session, ev.ArtifactRegistered.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="catalog.artifact.register",
        resource_type="artifact",
        resource_id=artifact_id,
        after=state.model_dump(mode="json"),
    )
    return artifact_view(row)


async def record_check(
    session: AsyncSession,
    principal: Principal,
    artifact_id: uuid.UUID,
    *,
    name: str,
    passed: bool,
    detail: str,
    system: bool = False,
) -> dict[str, Any]:
    """Record a lint/smoke result (or, from the service itself, a content re-verification).

    A recorded result that is already the latest one of its check (same outcome, same detail) is not
    recorded again: a request run twice (its first response lost with a crashed process, the retry's
    Idempotency-Key reservation taken over) leaves one record, one event and one audit entry."""
    await iam.authorize(session, principal, "catalog.artifact.promote")
    if name not in domain.RECORDABLE_CHECKS and not system:
        raise Unprocessable(f"checks that can be recorded: {', '.join(domain.RECORDABLE_CHECKS)}", code="check_unknown")
    row = await _artifact_for_update(session, artifact_id)
    if row.state == L.retired.value:
        raise Conflict("the artifact is retired", code="artifact_retired")
    before = artifact_state(row)
    check = _check_dict(name, passed, detail)
    latest = next((c for c in reversed(row.checks) if c["name"] == name), None)
    if not system and latest is not None and (latest["passed"], latest["detail"]) == (passed, check["detail"]):
        return artifact_view(row)
    await session.execute(
        update(artifacts)
        .where(artifacts.c.artifact_id == artifact_id)
        .values(checks=_with_check(row.checks, check), version=row.version + 1, updated_at=func.now())
    )
    row = (await session.execute(select(artifacts).where(artifacts.c.artifact_id == artifact_id))).one()
    state = artifact_state(row)
    await add_event(session, ev.ArtifactUpdated.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action=f"catalog.artifact.check.{name}",
        resource_type="artifact",
        resource_id=artifact_id,
        before={"checks": before.model_dump(mode="json")["checks"]},
        after={"check": check},
    )
    return artifact_view(row)


async def transition_artifact(
    session: AsyncSession,
    principal: Principal,
    artifact_id: uuid.UUID,
    *,
    target: ev.ArtifactLifecycle,
    reason: str,
    canary_tenants: list[uuid.UUID] | None,
    expected_version: int | None,
    reverified: Verified | None,
) -> dict[str, Any]:
    """Move an artifact in its lifecycle through the gates; deprecating it deprecates its manifests."""
    await iam.authorize(session, principal, "catalog.artifact.promote")
    row = await _artifact_for_update(session, artifact_id)
    check_version(row.version, expected_version)
    current = ev.ArtifactLifecycle(row.state)
    tenants = list(dict.fromkeys(canary_tenants or [])) if target is L.canary else []
    if target is L.canary:
        await _require_tenants(session, tenants)
    domain.check_transition(
        current,
        target,
        checks=row.checks,
        canary_tenants=tenants,
        instances_using=await instances_using(session, row.digest) if target is L.retired else 0,
    )
    checks = row.checks
    if reverified is not None:
        checks = _with_check(checks, _check_dict("content", True, "re-verified: " + "; ".join(reverified.detail)))
    before = artifact_state(row)
    await session.execute(
        update(artifacts)
        .where(artifacts.c.artifact_id == artifact_id)
        .values(
            state=target.value,
            canary_tenants=[str(t) for t in tenants],
            checks=checks,
            version=row.version + 1,
            updated_at=func.now(),
        )
    )
    await _history(
        session,
        principal,
        artifact_id,
        current.value,
        target.value,
        reason,
        {"canary_tenants": [str(t) for t in tenants]} if tenants else None,
    )
    row = (await session.execute(select(artifacts).where(artifacts.c.artifact_id == artifact_id))).one()
    state = artifact_state(row)
    transition = ev.ArtifactTransition(**state.model_dump(), from_state=current, reason=reason)
    await add_event(session, ev.ArtifactTransitioned.build(data=transition, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action=f"catalog.artifact.{target.value}",
        resource_type="artifact",
        resource_id=artifact_id,
        before={"state": before.state.value, "canary_tenants": [str(t) for t in before.canary_tenants]},
        after={"state": state.state.value, "canary_tenants": [str(t) for t in state.canary_tenants]},
        reason=reason,
    )
    if target is L.deprecated:
        # An active manifest cannot reference a non-active artifact: its manifests go with it.
        rows = await session.execute(
            select(manifests.c.manifest_id)
            .where(manifests.c.artifact_id == artifact_id, manifests.c.deprecated.is_(False))
            .with_for_update()
        )
        for (manifest_id,) in rows.all():
            await _deprecate_manifest(session, principal, manifest_id, f"artifact deprecated: {reason}")
    return artifact_view(row)


async def artifact_history(session: AsyncSession, artifact_id: uuid.UUID) -> list[dict[str, Any]]:
    if not (
        await session.execute(select(artifacts.c.artifact_id).where(artifacts.c.artifact_id == artifact_id))
    ).first():
        raise NotFound("artifact not found", code="artifact_not_found")
    rows = await session.execute(
        select(artifact_transitions)
        .where(artifact_transitions.c.artifact_id == artifact_id)
        .order_by(artifact_transitions.c.occurred_at, artifact_transitions.c.transition_id)
    )
    return [dict(r._mapping) for r in rows]


# ---------------------------------------------------------------------------------------- manifests


async def register_manifest(session: AsyncSession, principal: Principal, doc: dict[str, Any]) -> dict[str, Any]:
    await iam.authorize(session, principal, "catalog.app.register")
    m = domain.validate_manifest(doc)
    art = (await session.execute(select(artifacts).where(artifacts.c.ref == m["artifact_ref"]))).first()
    if art is None:
        raise Unprocessable(
            f"{m['artifact_ref']} is not a registered artifact; register (and verify) it first",
            code="artifact_not_registered",
        )
    app_kind = ev.AppArtifactKind(m["artifact_kind"])
    if art.kind != domain.artifact_kind_for(app_kind).value:
        raise Unprocessable(
            f"a {app_kind.value} app needs an {domain.artifact_kind_for(app_kind).value} artifact, not {art.kind}",
            code="artifact_kind_mismatch",
        )
    if art.state == L.retired.value:
        raise Conflict("the artifact is retired", code="artifact_retired")
    if m["active"] and art.state != L.active.value:
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
    row = (await session.execute(select(manifests).where(manifests.c.manifest_id == manifest_id))).one()
    state = manifest_state(row)
    await add_event(session, ev.AppRegistered.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="catalog.app.register",
        resource_type="app_manifest",
        resource_id=manifest_id,
        after=state.model_dump(mode="json"),
    )
    return manifest_view(row)


async def set_manifest_active(
    session: AsyncSession,
    principal: Principal,
    manifest_id: uuid.UUID,
    *,
    active: bool,
    reason: str,
    expected_revision: int | None,
) -> dict[str, Any]:
    await iam.authorize(session, principal, "catalog.app.register")
    row = await _manifest_for_update(session, manifest_id)
    check_version(row.revision, expected_revision)
    if active:
        if row.deprecated:
            raise Conflict("a deprecated manifest cannot be activated again", code="manifest_deprecated")
        art = (await session.execute(select(artifacts.c.state).where(artifacts.c.artifact_id == row.artifact_id))).one()
        if art.state != L.active.value:
            raise Conflict(
                f"an active manifest cannot reference a {art.state} artifact; promote the artifact first",
                code="artifact_not_active",
            )
    if row.active == active:
        return manifest_view(row)
    await session.execute(
        update(manifests)
        .where(manifests.c.manifest_id == manifest_id)
        .values(active=active, revision=row.revision + 1, updated_at=func.now())
    )
    row2 = (await session.execute(select(manifests).where(manifests.c.manifest_id == manifest_id))).one()
    state = manifest_state(row2)
    await add_event(session, ev.AppUpdated.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="catalog.app.activate" if active else "catalog.app.deactivate",
        resource_type="app_manifest",
        resource_id=manifest_id,
        before={"active": row.active},
        after={"active": active},
        reason=reason or None,
    )
    return manifest_view(row2)


async def _deprecate_manifest(
    session: AsyncSession, principal: Principal, manifest_id: uuid.UUID, reason: str
) -> dict[str, Any]:
    row = await _manifest_for_update(session, manifest_id)
    if row.deprecated:
        return manifest_view(row)
    await session.execute(
        update(manifests)
        .where(manifests.c.manifest_id == manifest_id)
        .values(active=False, deprecated=True, revision=row.revision + 1, updated_at=func.now())
    )
    row2 = (await session.execute(select(manifests).where(manifests.c.manifest_id == manifest_id))).one()
    state = manifest_state(row2)
    await add_event(session, ev.AppDeprecated.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="catalog.app.deprecate",
        resource_type="app_manifest",
        resource_id=manifest_id,
        before={"active": row.active, "deprecated": False},
        after={"active": False, "deprecated": True},
        reason=reason,
    )
    return manifest_view(row2)


async def deprecate_manifest(
    session: AsyncSession, principal: Principal, manifest_id: uuid.UUID, *, reason: str
) -> dict[str, Any]:
    await iam.authorize(session, principal, "catalog.app.register")
    return await _deprecate_manifest(session, principal, manifest_id, reason)


# ------------------------------------------------------------------------------------ entitlements


async def grant_entitlement(
    session: AsyncSession, principal: Principal, *, tenant_id: uuid.UUID, app_slug: str
) -> dict[str, Any]:
    await iam.authorize(session, principal, "catalog.entitlement.manage")
    await _require_tenants(session, [tenant_id])
    if not (await session.execute(select(manifests.c.manifest_id).where(manifests.c.slug == app_slug))).first():
        raise NotFound(f"no app {app_slug!r} is registered", code="app_not_found")
    row = (
        await session.execute(
            select(entitlements)
            .where(entitlements.c.tenant_id == tenant_id, entitlements.c.app_slug == app_slug)
            .with_for_update()
        )
    ).first()
    now = _now()
    if row is not None and row.status == "granted":
        raise Conflict(f"the tenant is already entitled to {app_slug}", code="already_entitled")
    if row is None:
        entitlement_id = new_event_id()
        await session.execute(
            insert(entitlements).values(
                entitlement_id=entitlement_id, tenant_id=tenant_id, app_slug=app_slug, status="granted", granted_at=now
            )
        )
    else:
        entitlement_id = row.entitlement_id
        await session.execute(
            update(entitlements)
            .where(entitlements.c.entitlement_id == entitlement_id)
            .values(status="granted", granted_at=now, revoked_at=None, version=row.version + 1)
        )
    row = (await session.execute(select(entitlements).where(entitlements.c.entitlement_id == entitlement_id))).one()
    state = entitlement_state(row)
    await add_event(session, ev.EntitlementGranted.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="catalog.entitlement.grant",
        resource_type="entitlement",
        resource_id=entitlement_id,
        tenant_id=tenant_id,
        after=state.model_dump(mode="json"),
    )
    return state.model_dump()


async def revoke_entitlement(
    session: AsyncSession, principal: Principal, entitlement_id: uuid.UUID, *, reason: str
) -> dict[str, Any]:
    await iam.authorize(session, principal, "catalog.entitlement.manage")
    row = (
        await session.execute(
            select(entitlements).where(entitlements.c.entitlement_id == entitlement_id).with_for_update()
        )
    ).first()
    if row is None:
        raise NotFound("entitlement not found", code="entitlement_not_found")
    if row.status == "revoked":
        raise Conflict("the entitlement is already revoked", code="entitlement_revoked")
    await session.execute(
        update(entitlements)
        .where(entitlements.c.entitlement_id == entitlement_id)
        .values(status="revoked", revoked_at=_now(), version=row.version + 1)
    )
    row2 = (await session.execute(select(entitlements).where(entitlements.c.entitlement_id == entitlement_id))).one()
    state = entitlement_state(row2)
    await add_event(session, ev.EntitlementRevoked.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="catalog.entitlement.revoke",
        resource_type="entitlement",
        resource_id=entitlement_id,
        tenant_id=row.tenant_id,
        before={"status": "granted"},
        after={"status": "revoked"},
        reason=reason or None,
    )
    return state.model_dump()


async def list_entitlements(session: AsyncSession, tenant_id: uuid.UUID | None) -> list[dict[str, Any]]:
    q = select(entitlements).order_by(entitlements.c.app_slug)
    if tenant_id is not None:
        q = q.where(entitlements.c.tenant_id == tenant_id)
    return [entitlement_state(r).model_dump() for r in await session.execute(q)]


# ---------------------------------------------------------------------------------------- reading


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


async def _entitled_slugs(session: AsyncSession, tenant_id: uuid.UUID) -> set[str]:
    rows = await session.execute(
        select(entitlements.c.app_slug).where(entitlements.c.tenant_id == tenant_id, entitlements.c.status == "granted")
    )
    return {r[0] for r in rows}


async def _manifests_with_artifacts(session: AsyncSession, where: list[Any]) -> list[tuple[Any, dict[str, Any]]]:
    q = (
        select(manifests, artifacts.c.state.label("artifact_state"), artifacts.c.canary_tenants)
        .join(artifacts, artifacts.c.artifact_id == manifests.c.artifact_id)
        .where(*where)
        .order_by(manifests.c.slug, manifests.c.created_at)
    )
    return [(r, {"state": r.artifact_state, "canary_tenants": r.canary_tenants}) for r in await session.execute(q)]


async def list_apps(
    session: AsyncSession, tenant_id: uuid.UUID | None, operator: bool, slug: str | None = None
) -> list[dict[str, Any]]:
    """Operators without a tenant see every manifest; a tenant sees the versions offered to it of
    the apps it is entitled to (active ones, plus canaries exposed to it)."""
    where = [manifests.c.slug == slug] if slug else []
    rows = await _manifests_with_artifacts(session, where)
    if operator and tenant_id is None:
        return [{**manifest_view(r), "artifact_state": a["state"]} for r, a in rows]
    assert tenant_id is not None
    entitled = await _entitled_slugs(session, tenant_id)
    out = []
    for r, a in rows:
        m = dict(r._mapping)
        if m["slug"] in entitled and domain.offered_to(m, a, tenant_id) is None:
            out.append({**manifest_view(r), "artifact_state": a["state"], "canary": a["state"] == L.canary.value})
    return out


async def get_manifest(
    session: AsyncSession, manifest_id: uuid.UUID, tenant_id: uuid.UUID | None, operator: bool
) -> dict[str, Any]:
    rows = await _manifests_with_artifacts(session, [manifests.c.manifest_id == manifest_id])
    if not rows:
        raise NotFound("app manifest not found", code="manifest_not_found")
    r, a = rows[0]
    if not (operator and tenant_id is None):
        assert tenant_id is not None
        m = dict(r._mapping)
        # Tenants see what is offered to them, and deprecated versions of apps they are entitled to
        # (their existing instances still run them).
        if m["slug"] not in await _entitled_slugs(session, tenant_id) or domain.offered_to(m, a, tenant_id) not in (
            None,
            "manifest_deprecated",
        ):
            raise NotFound("app manifest not found", code="manifest_not_found")
    return {**manifest_view(r), "artifact_state": a["state"]}


async def check_compatibility(
    session: AsyncSession,
    *,
    slug: str,
    version: str | None,
    tenant_id: uuid.UUID | None,
    shape: domain.AllocationShape,
) -> dict[str, Any]:
    where = [manifests.c.slug == slug] + ([manifests.c.version == version] if version else [])
    rows = await _manifests_with_artifacts(session, where)
    if tenant_id is not None and slug not in await _entitled_slugs(session, tenant_id):
        rows = []  # not entitled: the app does not exist for this tenant
    if not rows:
        raise NotFound(f"no app {slug!r}" + (f" version {version}" if version else ""), code="app_not_found")
    candidates = rows
    if version is None and tenant_id is not None:
        offered = [(r, a) for r, a in rows if domain.offered_to(dict(r._mapping), a, tenant_id) is None]
        candidates = offered or rows
    r, a = candidates[-1]  # newest registered
    m = dict(r._mapping)
    reasons = domain.compatibility_reasons(m["compatibility"], shape)
    not_offered = (
        domain.offered_to(m, a, tenant_id)
        if tenant_id is not None
        else ("manifest_deprecated" if m["deprecated"] else None if m["active"] else "manifest_not_active")
    )
    deploy_reasons = [{"code": not_offered, "message": domain.NOT_OFFERED_MESSAGES[not_offered]}] if not_offered else []
    return {
        "manifest_id": m["manifest_id"],
        "slug": m["slug"],
        "version": m["version"],
        "runtime_version": m["runtime_version"],
        "compatible": not reasons,
        "deployable": not reasons and not deploy_reasons,
        "reasons": reasons + deploy_reasons,
    }


async def snapshot(
    session: AsyncSession, entity: str, after: uuid.UUID | None, limit: int
) -> tuple[list[dict[str, Any]], uuid.UUID | None]:
    table, key, to_state = {
        "manifests": (manifests, manifests.c.manifest_id, manifest_state),
        "artifacts": (artifacts, artifacts.c.artifact_id, artifact_state),
        "entitlements": (entitlements, entitlements.c.entitlement_id, entitlement_state),
    }[entity]
    q = select(table).order_by(key).limit(limit)
    if after is not None:
        q = q.where(key > after)
    rows = (await session.execute(q)).all()
    items = [to_state(r).model_dump(mode="json") for r in rows]
    nxt = getattr(rows[-1], key.name) if len(rows) == limit else None
    return items, nxt
