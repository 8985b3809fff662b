"""For those who publish apps (platform operators and their pipelines): artifacts (registration
against the registry, checks, re-verification, promotion through the lifecycle) and app manifests
(registration, activation, deprecation)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query
from fastapi.types import DecoratedCallable

from gpuaas.catalog import service
from gpuaas.catalog.api.schemas import (
    Artifact,
    ArtifactRegister,
    CheckRecord,
    Manifest,
    Reason,
    RequiredReason,
    Transition,
    TransitionRecord,
    Verification,
)
from gpuaas.catalog.runtime import CatalogRuntime
from gpuaas.contracts.events.catalog import ArtifactKind, ArtifactLifecycle
from gpuaas.kit.app import Kit, KitRuntime
from gpuaas.kit.auth import CurrentPrincipal, Principal
from gpuaas.kit.iam import action_doc, require
from gpuaas.kit.versioning import ExpectedVersion

router = APIRouter()
OperatorRead = Annotated[Principal, Depends(require("catalog.artifact.read"))]


# ------------------------------------------------------------------------------------------ artifacts


@router.post(
    "/artifacts",
    response_model=Artifact,
    status_code=201,
    tags=["artifacts"],
    openapi_extra=action_doc("catalog.artifact.register"),
)
async def register_artifact(kit: Kit, body: ArtifactRegister, principal: CurrentPrincipal) -> Any:
    """Register a digest after verifying it against the registry: the manifest and every blob it names
    are downloaded and hashed; a wrong digest, a missing manifest or altered content is refused.
    With `public_key`, a cosign signature of the digest must verify too."""
    return await service.register_verified_artifact(
        kit.sessions,
        kit.state_as(CatalogRuntime),
        principal,
        ref=body.ref,
        kind=body.kind,
        public_key=body.public_key,
    )


@router.get("/artifacts", response_model=list[Artifact], tags=["artifacts"])
async def list_artifacts(
    kit: Kit,
    _: OperatorRead,
    state: ArtifactLifecycle | None = None,
    kind: ArtifactKind | None = None,
    limit: int = Query(200, ge=1, le=1000),
    offset: int = Query(0, ge=0),
) -> Any:
    async with kit.sessions() as session:
        return await service.list_artifacts(session, state=state, kind=kind, limit=limit, offset=offset)


@router.get("/artifacts/{artifact_id}", response_model=Artifact, tags=["artifacts"])
async def get_artifact(kit: Kit, artifact_id: uuid.UUID, _: OperatorRead) -> Any:
    async with kit.sessions() as session:
        return await service.get_artifact(session, artifact_id)


@router.get("/artifacts/{artifact_id}/history", response_model=list[TransitionRecord], tags=["artifacts"])
async def artifact_history(kit: Kit, artifact_id: uuid.UUID, _: OperatorRead) -> Any:
    async with kit.sessions() as session:
        return await service.artifact_history(session, artifact_id)


@router.post(
    "/artifacts/{artifact_id}/checks",
    response_model=Artifact,
    tags=["artifacts"],
    openapi_extra=action_doc("catalog.artifact.promote"),
)
async def record_check(kit: Kit, artifact_id: uuid.UUID, body: CheckRecord, principal: CurrentPrincipal) -> Any:
    """Record a lint or smoke result (staging needs both passing)."""
    async with kit.sessions() as session, session.begin():
        return await service.record_check(
            session, principal, artifact_id, name=body.name, passed=body.passed, detail=body.detail
        )


@router.post(
    "/artifacts/{artifact_id}/verify",
    response_model=Verification,
    tags=["artifacts"],
    openapi_extra=action_doc("catalog.artifact.promote"),
)
async def reverify(kit: Kit, artifact_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    """Verify the stored digest against the registry now; the result is recorded as the `content` check."""
    return await service.reverify_artifact(kit.sessions, kit.state_as(CatalogRuntime), principal, artifact_id)


@router.post(
    "/artifacts/{artifact_id}/transitions",
    response_model=Artifact,
    tags=["artifacts"],
    openapi_extra=action_doc("catalog.artifact.promote"),
)
async def transition_artifact(
    kit: Kit,
    artifact_id: uuid.UUID,
    body: Transition,
    principal: CurrentPrincipal,
    expected: ExpectedVersion,
) -> Any:
    """Promote, roll back (canary → staged), deprecate or retire. Moving towards production
    (staged, canary, active) re-verifies the content in the registry first: altered content is refused."""
    return await service.promote_artifact(
        kit.sessions,
        kit.state_as(CatalogRuntime),
        principal,
        artifact_id,
        target=body.to,
        reason=body.reason,
        canary_tenants=body.canary_tenants,
        expected_version=expected,
    )


# ------------------------------------------------------------------------------------------- manifests


def _manifest_change(path: str) -> Callable[[DecoratedCallable], DecoratedCallable]:
    return router.post(path, response_model=Manifest, tags=["apps"], openapi_extra=action_doc("catalog.app.register"))


@router.post(
    "/apps",
    response_model=Manifest,
    status_code=201,
    tags=["apps"],
    openapi_extra=action_doc("catalog.app.register"),
)
async def register_app(kit: Kit, principal: CurrentPrincipal, body: Annotated[dict[str, Any], Body()]) -> Any:
    """Register an app manifest version (validated against `GET /schemas/manifest`; a launchable app's
    `runtime_profile` against `GET /schemas/launchable-profile`). `artifact_ref` must be a registered
    artifact's digest-pinned reference; a tag is refused."""
    async with kit.sessions() as session, session.begin():
        return await service.register_manifest(session, principal, body)


@_manifest_change("/manifests/{manifest_id}/activate")
async def activate(
    kit: Kit, manifest_id: uuid.UUID, principal: CurrentPrincipal, expected: ExpectedVersion, body: Reason | None = None
) -> Any:
    """Offer the version to entitled tenants; refused unless its artifact is active."""
    return await _set_active(kit, principal, manifest_id, active=True, body=body, expected=expected)


@_manifest_change("/manifests/{manifest_id}/deactivate")
async def deactivate(
    kit: Kit, manifest_id: uuid.UUID, principal: CurrentPrincipal, expected: ExpectedVersion, body: Reason | None = None
) -> Any:
    return await _set_active(kit, principal, manifest_id, active=False, body=body, expected=expected)


async def _set_active(
    kit: KitRuntime,
    principal: Principal,
    manifest_id: uuid.UUID,
    *,
    active: bool,
    body: Reason | None,
    expected: int | None,
) -> Manifest:
    async with kit.sessions() as session, session.begin():
        return await service.set_manifest_active(
            session,
            principal,
            manifest_id,
            active=active,
            reason=body.reason if body else "",
            expected_version=expected,
        )


@_manifest_change("/manifests/{manifest_id}/deprecate")
async def deprecate(kit: Kit, manifest_id: uuid.UUID, body: RequiredReason, principal: CurrentPrincipal) -> Any:
    """Existing instances continue; no new instance may use this version."""
    async with kit.sessions() as session, session.begin():
        return await service.deprecate_manifest(session, principal, manifest_id, reason=body.reason)
