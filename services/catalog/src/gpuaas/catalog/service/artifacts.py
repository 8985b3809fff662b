"""Artifact use cases: register a verified digest, record checks, move through the lifecycle
gates, and read artifacts with their history. Each runs in the caller's one transaction."""

from __future__ import annotations

import uuid

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.catalog import domain
from gpuaas.catalog.models import artifact_transitions, artifacts, manifests
from gpuaas.catalog.oci import SignatureResult, Verified
from gpuaas.catalog.service.common import (
    artifact_for_update,
    artifact_state,
    artifact_view,
    check_record,
    instances_using,
    publish,
    require_tenants,
    row_of,
    with_check,
)
from gpuaas.catalog.service.manifests import deprecate_manifest_unchecked
from gpuaas.catalog.service.views import Artifact, TransitionRecord
from gpuaas.contracts import new_event_id
from gpuaas.contracts.events import catalog as catalog_events
from gpuaas.contracts.events.catalog import ArtifactKind, ArtifactLifecycle
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound, Unprocessable
from gpuaas.kit.versioning import check_version


async def _add_history(
    session: AsyncSession,
    principal: Principal,
    artifact_id: uuid.UUID,
    from_state: str | None,
    to_state: str,
    reason: str,
    detail: dict[str, object] | None = None,
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


async def register_artifact(
    session: AsyncSession,
    principal: Principal,
    *,
    kind: ArtifactKind,
    verified: Verified,
    signature: SignatureResult | None,
) -> Artifact:
    """Record a verified digest as a `draft` artifact (its content check recorded as passed)."""
    await iam.authorize(session, principal, "catalog.artifact.register")
    ref = verified.reference
    if (await session.execute(select(artifacts.c.artifact_id).where(artifacts.c.ref == ref.ref))).first():
        raise Conflict(f"{ref.ref} is already registered", code="artifact_already_registered")
    artifact_id = new_event_id()
    checks = [check_record("content", True, "; ".join(verified.detail))]
    if signature is not None:
        checks.append(check_record("signature", signature.verified, signature.detail))
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
            state=ArtifactLifecycle.draft.value,
            checks=checks,
            signature_verified=bool(signature and signature.verified),
            signature_detail=signature.detail if signature else None,
        )
    )
    await _add_history(
        session, principal, artifact_id, None, ArtifactLifecycle.draft.value, "registered", {"ref": ref.ref}
    )
    row = await row_of(session, artifacts, "artifact_id", artifact_id)
    state = artifact_state(row)
    await publish(
        session,
        principal,
        catalog_events.ArtifactRegistered,
        state,
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
) -> Artifact:
    """Record a lint/smoke result (or, from the service itself, a content re-verification).

    A result that is already the latest one of its check (same outcome, same detail) is not recorded
    again: a pipeline re-posting its result (a retry without an Idempotency-Key; a keyed retry of a
    committed request is stopped earlier by the kit's idempotency middleware) leaves one record, one
    event and one audit entry."""
    await iam.authorize(session, principal, "catalog.artifact.promote")
    if name not in domain.RECORDABLE_CHECKS and not system:
        raise Unprocessable(f"checks that can be recorded: {', '.join(domain.RECORDABLE_CHECKS)}", code="check_unknown")
    row = await artifact_for_update(session, artifact_id)
    if row.state == ArtifactLifecycle.retired.value:
        raise Conflict("the artifact is retired", code="artifact_retired")
    before = artifact_state(row)
    check = check_record(name, passed, detail)
    latest = next((c for c in reversed(row.checks) if c["name"] == name), None)
    if not system and latest is not None and (latest["passed"], latest["detail"]) == (passed, check["detail"]):
        return artifact_view(row)
    await session.execute(
        update(artifacts)
        .where(artifacts.c.artifact_id == artifact_id)
        .values(checks=with_check(row.checks, check), version=row.version + 1, updated_at=func.now())
    )
    row = await row_of(session, artifacts, "artifact_id", artifact_id)
    await publish(
        session,
        principal,
        catalog_events.ArtifactUpdated,
        artifact_state(row),
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
    target: ArtifactLifecycle,
    reason: str,
    canary_tenants: list[uuid.UUID] | None,
    expected_version: int | None,
    reverified: Verified | None,
) -> Artifact:
    """Move an artifact in its lifecycle through the gates; deprecating it deprecates its manifests."""
    await iam.authorize(session, principal, "catalog.artifact.promote")
    row = await artifact_for_update(session, artifact_id)
    check_version(row.version, expected_version)
    current = ArtifactLifecycle(row.state)
    tenants = list(dict.fromkeys(canary_tenants or [])) if target is ArtifactLifecycle.canary else []
    if target is ArtifactLifecycle.canary:
        await require_tenants(session, tenants)
    domain.check_transition(
        current,
        target,
        checks=row.checks,
        canary_tenants=tenants,
        instances_using=await instances_using(session, row.digest) if target is ArtifactLifecycle.retired else 0,
    )
    checks = row.checks
    if reverified is not None:
        checks = with_check(checks, check_record("content", True, "re-verified: " + "; ".join(reverified.detail)))
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
    await _add_history(
        session,
        principal,
        artifact_id,
        current.value,
        target.value,
        reason,
        {"canary_tenants": [str(t) for t in tenants]} if tenants else None,
    )
    row = await row_of(session, artifacts, "artifact_id", artifact_id)
    state = artifact_state(row)
    await publish(
        session,
        principal,
        catalog_events.ArtifactTransitioned,
        catalog_events.ArtifactTransition(**state.model_dump(), from_state=current, reason=reason),
        action=f"catalog.artifact.{target.value}",
        resource_type="artifact",
        resource_id=artifact_id,
        before={"state": before.state.value, "canary_tenants": [str(t) for t in before.canary_tenants]},
        after={"state": state.state.value, "canary_tenants": [str(t) for t in state.canary_tenants]},
        reason=reason,
    )
    if target is ArtifactLifecycle.deprecated:
        # An active manifest cannot reference a non-active artifact: its manifests go with it.
        rows = await session.execute(
            select(manifests.c.manifest_id)
            .where(manifests.c.artifact_id == artifact_id, manifests.c.deprecated.is_(False))
            .with_for_update()
        )
        for (manifest_id,) in rows.all():
            await deprecate_manifest_unchecked(session, principal, manifest_id, f"artifact deprecated: {reason}")
    return artifact_view(row)


# ---------------------------------------------------------------------------------------- reading


async def list_artifacts(
    session: AsyncSession,
    *,
    state: ArtifactLifecycle | None,
    kind: ArtifactKind | None,
    limit: int,
    offset: int,
) -> list[Artifact]:
    query = select(artifacts).order_by(artifacts.c.created_at).limit(limit).offset(offset)
    if state is not None:
        query = query.where(artifacts.c.state == state.value)
    if kind is not None:
        query = query.where(artifacts.c.kind == kind.value)
    return [artifact_view(row) for row in await session.execute(query)]


async def get_artifact(session: AsyncSession, artifact_id: uuid.UUID) -> Artifact:
    row = (await session.execute(select(artifacts).where(artifacts.c.artifact_id == artifact_id))).first()
    if row is None:
        raise NotFound("artifact not found", code="artifact_not_found")
    return artifact_view(row)


async def artifact_history(session: AsyncSession, artifact_id: uuid.UUID) -> list[TransitionRecord]:
    if not (
        await session.execute(select(artifacts.c.artifact_id).where(artifacts.c.artifact_id == artifact_id))
    ).first():
        raise NotFound("artifact not found", code="artifact_not_found")
    rows = await session.execute(
        select(artifact_transitions)
        .where(artifact_transitions.c.artifact_id == artifact_id)
        .order_by(artifact_transitions.c.occurred_at, artifact_transitions.c.transition_id)
    )
    return [TransitionRecord.model_validate(dict(row._mapping)) for row in rows]
