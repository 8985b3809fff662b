"""Registry-backed use cases: register, re-verify and promote artifacts.

"Never make network calls inside a DB transaction": each of these authorizes, talks to the registry
(content verification by hashing, cosign signature checks) with no transaction open, and only then
runs ONE transaction with the artifact use case that records the result."""

from __future__ import annotations

import uuid

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.catalog.oci import Reference, TrustError, Verified, parse_ref
from gpuaas.catalog.runtime import CatalogRuntime
from gpuaas.catalog.service.artifacts import get_artifact, record_check, register_artifact, transition_artifact
from gpuaas.catalog.service.common import trust_problem
from gpuaas.catalog.service.views import Artifact, Verification
from gpuaas.contracts.events.catalog import ArtifactKind, ArtifactLifecycle
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Problem

Sessions = async_sessionmaker[AsyncSession]
# Moving towards production re-verifies the content first.
REVERIFIED_TARGETS = (ArtifactLifecycle.staged, ArtifactLifecycle.canary, ArtifactLifecycle.active)


async def _authorize(sessions: Sessions, principal: Principal, action: str) -> None:
    """Checked before any registry traffic (and again by the use case, in its transaction)."""
    async with sessions() as session:
        await iam.authorize(session, principal, action)


async def _read_artifact(sessions: Sessions, artifact_id: uuid.UUID) -> Artifact:
    async with sessions() as session:
        return await get_artifact(session, artifact_id)


async def _verify(runtime: CatalogRuntime, ref: Reference, kind: ArtifactKind) -> Verified:
    """Hash the content the registry serves for `ref`; counted by outcome. Raises TrustError."""
    try:
        verified = await runtime.registry.verify(ref, allow_raw_blob=kind is ArtifactKind.blob)
    except TrustError as exc:
        runtime.verifications.labels(exc.code).inc()
        raise
    runtime.verifications.labels("verified").inc()
    return verified


async def register_verified_artifact(
    sessions: Sessions,
    runtime: CatalogRuntime,
    principal: Principal,
    *,
    ref: str,
    kind: ArtifactKind,
    public_key: str | None,
) -> Artifact:
    """Verify the digest's content (and, with `public_key`, a cosign signature of it), then register it."""
    try:
        reference = parse_ref(ref)
        await _authorize(sessions, principal, "catalog.artifact.register")
        verified = await _verify(runtime, reference, kind)
        signature = await runtime.registry.verify_signature(reference, public_key) if public_key else None
    except TrustError as exc:
        raise trust_problem(exc) from None
    if signature is not None and not signature.verified:
        raise Problem(signature.detail, code="signature_invalid", status=422, title="Artifact refused")
    async with sessions() as session, session.begin():
        return await register_artifact(session, principal, kind=kind, verified=verified, signature=signature)


async def reverify_artifact(
    sessions: Sessions, runtime: CatalogRuntime, principal: Principal, artifact_id: uuid.UUID
) -> Verification:
    """Verify the stored digest against the registry now and record the result as the `content` check.
    Altered content is a verdict (passed: false), not an error; an unreachable registry is."""
    await _authorize(sessions, principal, "catalog.artifact.promote")
    artifact = await _read_artifact(sessions, artifact_id)
    code: str | None = None
    try:
        verified = await _verify(runtime, parse_ref(artifact.ref), artifact.kind)
        passed, detail = True, "re-verified: " + "; ".join(verified.detail)
    except TrustError as exc:
        if exc.status != 422:
            raise trust_problem(exc) from None
        passed, code, detail = False, exc.code, exc.detail
    async with sessions() as session, session.begin():
        view = await record_check(
            session, principal, artifact_id, name="content", passed=passed, detail=detail, system=True
        )
    return Verification(passed=passed, code=code, detail=detail, artifact=view)


async def promote_artifact(
    sessions: Sessions,
    runtime: CatalogRuntime,
    principal: Principal,
    artifact_id: uuid.UUID,
    *,
    target: ArtifactLifecycle,
    reason: str,
    canary_tenants: list[uuid.UUID],
    expected_version: int | None,
) -> Artifact:
    """Move the artifact to `target` through the gates. Towards production (staged, canary, active) the
    content is re-verified first: altered content is recorded as a failed `content` check and refused."""
    await _authorize(sessions, principal, "catalog.artifact.promote")
    reverified = None
    if target in REVERIFIED_TARGETS:
        artifact = await _read_artifact(sessions, artifact_id)
        try:
            reverified = await _verify(runtime, parse_ref(artifact.ref), artifact.kind)
        except TrustError as exc:
            if exc.status == 422:  # keep the failed verification on record, then refuse
                async with sessions() as session, session.begin():
                    await record_check(
                        session, principal, artifact_id, name="content", passed=False, detail=exc.detail, system=True
                    )
            raise trust_problem(exc) from None
    async with sessions() as session, session.begin():
        view = await transition_artifact(
            session,
            principal,
            artifact_id,
            target=target,
            reason=reason,
            canary_tenants=canary_tenants,
            expected_version=expected_version,
            reverified=reverified,
        )
    runtime.transitions.labels(target.value).inc()
    return view
