"""Catalog's HTTP surface (thin: request shapes and registry I/O here, rules in domain/service)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Header, Query, Request
from pydantic import BaseModel, Field

from gpuaas.catalog import domain, seed, service
from gpuaas.catalog.models import artifacts
from gpuaas.catalog.oci import RegistryClient, TrustError, Verified, parse_ref
from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events.catalog import ArtifactKind, ArtifactLifecycle
from gpuaas.kit import iam
from gpuaas.kit.auth import CurrentPrincipal, Principal
from gpuaas.kit.errors import NotFound, Problem
from gpuaas.kit.iam import require
from gpuaas.kit.versioning import expected_version

router = APIRouter()
SLUG = domain.SLUG_PATTERN


# ---------------------------------------------------------------------------------- request models


class ArtifactRegister(BaseModel):
    ref: str = Field(max_length=512, description="registry/repository@sha256:<64 hex>; a tag is refused")
    kind: ArtifactKind = ArtifactKind.oci
    public_key: str | None = Field(
        None, max_length=10_000, description="PEM public key of a cosign key pair: the signature must verify"
    )


class CheckRecord(BaseModel):
    name: Literal["lint", "smoke"]
    passed: bool
    detail: str = Field("", max_length=2000)


class Transition(BaseModel):
    to: ArtifactLifecycle
    reason: str = Field(min_length=1, max_length=1000, description="why (kept in the audit trail)")
    canary_tenants: list[uuid.UUID] = Field(default_factory=list, max_length=1000)


class Reason(BaseModel):
    reason: str = Field("", max_length=1000)


class RequiredReason(BaseModel):
    reason: str = Field(min_length=1, max_length=1000)


class EntitlementGrant(BaseModel):
    tenant_id: uuid.UUID
    app_slug: str = Field(pattern=SLUG)


class CompatibilityQuery(BaseModel):
    version: str | None = Field(None, max_length=100)
    tenant_id: uuid.UUID | None = None
    capacity_shape: CapacityShape
    gpu_count: int = Field(ge=0, le=1024)
    exclusive_node: bool = False
    allocation_count: int = Field(1, ge=1, le=1024)


class SeedRequest(BaseModel):
    registry: str = Field(max_length=255, description="host:port of the OCI registry to push the seed artifacts to")
    tenant_ids: list[uuid.UUID] = Field(min_length=1, max_length=100)


class Check(BaseModel):
    name: str
    passed: bool
    recorded_at: datetime
    detail: str


class Artifact(BaseModel):
    artifact_id: uuid.UUID
    kind: ArtifactKind
    ref: str
    registry: str
    repository: str
    digest: str
    media_type: str | None
    artifact_type: str | None
    size_bytes: int | None
    state: ArtifactLifecycle
    canary_tenants: list[uuid.UUID]
    checks: list[Check]
    signature_verified: bool
    signature_detail: str | None
    version: int
    created_at: datetime
    updated_at: datetime


class TransitionRecord(BaseModel):
    transition_id: uuid.UUID
    from_state: str | None
    to_state: str
    actor_kind: str
    actor_id: str
    reason: str
    detail: dict[str, Any]
    occurred_at: datetime


class Verification(BaseModel):
    passed: bool
    code: str | None = None
    detail: str
    artifact: Artifact


class Manifest(BaseModel):
    manifest_id: uuid.UUID
    slug: str
    display_name: str
    description: str
    version: str = Field(description="the app's own version")
    runtime_version: str | None = Field(description="what it installs (e.g. Slurm 22.05), shown separately")
    artifact_kind: str
    artifact_ref: str
    artifact_id: uuid.UUID | None
    artifact_state: str
    canary: bool = False
    compatibility: dict[str, Any]
    runtime_profile: dict[str, Any] | None
    inputs: dict[str, Any]
    roles: list[dict[str, Any]]
    active: bool
    deprecated: bool
    revision: int
    created_at: datetime
    updated_at: datetime


class Entitlement(BaseModel):
    entitlement_id: uuid.UUID
    tenant_id: uuid.UUID
    app_slug: str
    status: str
    granted_at: datetime
    revoked_at: datetime | None
    version: int


class Reason_(BaseModel):
    code: str
    message: str


class CompatibilityVerdict(BaseModel):
    manifest_id: uuid.UUID
    slug: str
    version: str
    runtime_version: str | None
    compatible: bool = Field(description="the allocation offers what the app needs")
    deployable: bool = Field(description="compatible, and the version is offered to the tenant")
    reasons: list[Reason_]


# --------------------------------------------------------------------------------------- helpers


def _kit(request: Request) -> Any:
    return request.app.state.kit


def _registry(request: Request) -> RegistryClient:
    s = _kit(request).settings
    return RegistryClient(s.registry_plain_http, s.registry_timeout_s)


def _trust_problem(exc: TrustError) -> Problem:
    title = "Artifact refused" if exc.status == 422 else "Registry unavailable"
    return Problem(exc.detail, code=exc.code, status=exc.status, title=title)


async def _authorized(request: Request, principal: Principal, action: str) -> None:
    async with _kit(request).sessions() as session:
        await iam.authorize(session, principal, action)


def _count(request: Request, name: str, label: str) -> None:
    counter = _kit(request).extras.get(name)
    if counter is not None:
        counter.labels(label).inc()


async def _verify(request: Request, ref: str, kind: ArtifactKind) -> Verified:
    try:
        verified = await _registry(request).verify(parse_ref(ref), allow_raw_blob=kind is ArtifactKind.blob)
    except TrustError as exc:
        _count(request, "verifications", exc.code)
        raise _trust_problem(exc) from None
    _count(request, "verifications", "verified")
    return verified


OperatorRead = Annotated[Principal, Depends(require("catalog.artifact.read"))]


# ------------------------------------------------------------------------------------- artifacts


@router.post(
    "/artifacts",
    response_model=Artifact,
    status_code=201,
    tags=["artifacts"],
    openapi_extra=iam.action_doc("catalog.artifact.register"),
)
async def register_artifact(request: Request, body: ArtifactRegister, principal: CurrentPrincipal) -> Any:
    """Register a digest after verifying it against the registry: the manifest and every blob it names
    are downloaded and hashed; a wrong digest, a missing manifest or altered content is refused.
    With `public_key`, a cosign signature of the digest must verify too."""
    try:
        reference = parse_ref(body.ref)
    except TrustError as exc:
        raise _trust_problem(exc) from None
    await _authorized(request, principal, "catalog.artifact.register")
    verified = await _verify(request, reference.ref, body.kind)
    signature = None
    if body.public_key:
        try:
            signature = await _registry(request).verify_signature(reference, body.public_key)
        except TrustError as exc:
            raise _trust_problem(exc) from None
        if not signature.verified:
            raise Problem(signature.detail, code="signature_invalid", status=422, title="Artifact refused")
    async with _kit(request).sessions() as session, session.begin():
        return await service.register_artifact(
            session, principal, kind=body.kind, verified=verified, signature=signature
        )


@router.get("/artifacts", response_model=list[Artifact], tags=["artifacts"])
async def list_artifacts(
    request: Request,
    _: OperatorRead,
    state: ArtifactLifecycle | None = None,
    kind: ArtifactKind | None = None,
    limit: int = Query(200, ge=1, le=1000),
    offset: int = Query(0, ge=0),
) -> Any:
    from sqlalchemy import select

    q = select(artifacts).order_by(artifacts.c.created_at).limit(limit).offset(offset)
    if state is not None:
        q = q.where(artifacts.c.state == state.value)
    if kind is not None:
        q = q.where(artifacts.c.kind == kind.value)
    async with _kit(request).sessions() as session:
        return [service.artifact_view(r) for r in await session.execute(q)]


async def _get_artifact(request: Request, artifact_id: uuid.UUID) -> dict[str, Any]:
    from sqlalchemy import select

    async with _kit(request).sessions() as session:
        row = (await session.execute(select(artifacts).where(artifacts.c.artifact_id == artifact_id))).first()
    if row is None:
        raise NotFound("artifact not found", code="artifact_not_found")
    return service.artifact_view(row)


@router.get("/artifacts/{artifact_id}", response_model=Artifact, tags=["artifacts"])
async def get_artifact(request: Request, artifact_id: uuid.UUID, _: OperatorRead) -> Any:
    return await _get_artifact(request, artifact_id)


@router.get("/artifacts/{artifact_id}/history", response_model=list[TransitionRecord], tags=["artifacts"])
async def artifact_history(request: Request, artifact_id: uuid.UUID, _: OperatorRead) -> Any:
    async with _kit(request).sessions() as session:
        return await service.artifact_history(session, artifact_id)


@router.post(
    "/artifacts/{artifact_id}/checks",
    response_model=Artifact,
    tags=["artifacts"],
    openapi_extra=iam.action_doc("catalog.artifact.promote"),
)
async def record_check(request: Request, artifact_id: uuid.UUID, body: CheckRecord, principal: CurrentPrincipal) -> Any:
    """Record a lint or smoke result (staging needs both passing)."""
    async with _kit(request).sessions() as session, session.begin():
        return await service.record_check(
            session, principal, artifact_id, name=body.name, passed=body.passed, detail=body.detail
        )


@router.post(
    "/artifacts/{artifact_id}/verify",
    response_model=Verification,
    tags=["artifacts"],
    openapi_extra=iam.action_doc("catalog.artifact.promote"),
)
async def reverify(request: Request, artifact_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    """Verify the stored digest against the registry now; the result is recorded as the `content` check."""
    await _authorized(request, principal, "catalog.artifact.promote")
    art = await _get_artifact(request, artifact_id)
    passed, code, detail = await _content_check(request, art)
    async with _kit(request).sessions() as session, session.begin():
        view = await service.record_check(
            session, principal, artifact_id, name="content", passed=passed, detail=detail, system=True
        )
    return {"passed": passed, "code": code, "detail": detail, "artifact": view}


async def _content_check(request: Request, art: dict[str, Any]) -> tuple[bool, str | None, str]:
    try:
        verified = await _registry(request).verify(
            parse_ref(art["ref"]), allow_raw_blob=art["kind"] == ArtifactKind.blob.value
        )
    except TrustError as exc:
        _count(request, "verifications", exc.code)
        if exc.status != 422:
            raise _trust_problem(exc) from None
        return False, exc.code, exc.detail
    _count(request, "verifications", "verified")
    return True, None, "re-verified: " + "; ".join(verified.detail)


@router.post(
    "/artifacts/{artifact_id}/transitions",
    response_model=Artifact,
    tags=["artifacts"],
    openapi_extra=iam.action_doc("catalog.artifact.promote"),
)
async def transition_artifact(
    request: Request,
    artifact_id: uuid.UUID,
    body: Transition,
    principal: CurrentPrincipal,
    if_match: Annotated[str | None, Header()] = None,
) -> Any:
    """Promote, roll back (canary → staged), deprecate or retire. Moving towards production
    (staged, canary, active) re-verifies the content in the registry first: altered content is refused."""
    await _authorized(request, principal, "catalog.artifact.promote")
    expected = expected_version(if_match)
    reverified = None
    if body.to in (ArtifactLifecycle.staged, ArtifactLifecycle.canary, ArtifactLifecycle.active):
        art = await _get_artifact(request, artifact_id)
        try:
            reverified = await _registry(request).verify(
                parse_ref(art["ref"]), allow_raw_blob=art["kind"] == ArtifactKind.blob.value
            )
        except TrustError as exc:
            _count(request, "verifications", exc.code)
            if exc.status == 422:  # keep the failed verification on record, then refuse
                async with _kit(request).sessions() as session, session.begin():
                    await service.record_check(
                        session, principal, artifact_id, name="content", passed=False, detail=exc.detail, system=True
                    )
            raise _trust_problem(exc) from None
    async with _kit(request).sessions() as session, session.begin():
        view = await service.transition_artifact(
            session,
            principal,
            artifact_id,
            target=body.to,
            reason=body.reason,
            canary_tenants=body.canary_tenants,
            expected_version=expected,
            reverified=reverified,
        )
    _count(request, "transitions", body.to.value)
    return view


# ------------------------------------------------------------------------------------------ apps


@router.get("/schemas/manifest", tags=["apps"])
async def manifest_schema(_: CurrentPrincipal) -> dict[str, Any]:
    return domain.MANIFEST_SCHEMA


@router.get("/schemas/launchable-profile", tags=["apps"])
async def launchable_profile_schema(_: CurrentPrincipal) -> dict[str, Any]:
    return domain.LAUNCHABLE_PROFILE_SCHEMA


@router.post(
    "/apps",
    response_model=Manifest,
    status_code=201,
    tags=["apps"],
    openapi_extra=iam.action_doc("catalog.app.register"),
)
async def register_app(request: Request, principal: CurrentPrincipal, body: Annotated[dict[str, Any], Body()]) -> Any:
    """Register an app manifest version (validated against `GET /schemas/manifest`; a launchable app's
    `runtime_profile` against `GET /schemas/launchable-profile`). `artifact_ref` must be a registered
    artifact's digest-pinned reference; a tag is refused."""
    ref = body.get("artifact_ref")
    if isinstance(ref, str):
        try:
            parse_ref(ref)
        except TrustError as exc:
            raise _trust_problem(exc) from None
    async with _kit(request).sessions() as session, session.begin():
        view = await service.register_manifest(session, principal, body)
    return {**view, "artifact_state": await _artifact_state(request, view["artifact_id"])}


async def _artifact_state(request: Request, artifact_id: uuid.UUID) -> str:
    return (await _get_artifact(request, artifact_id))["state"]


@router.get("/apps", response_model=list[Manifest], tags=["apps"])
async def list_apps(
    request: Request,
    principal: CurrentPrincipal,
    tenant_id: uuid.UUID | None = None,
    slug: str | None = Query(None, pattern=SLUG),
) -> Any:
    """A tenant sees the entitled apps' versions offered to it (active, or a canary exposed to it);
    operators without `tenant_id` see every manifest; with it, what that tenant sees."""
    async with _kit(request).sessions() as session:
        tid, operator = await service.reader_tenant(session, principal, tenant_id)
        return await service.list_apps(session, tid, operator, slug)


@router.get("/apps/{slug}", response_model=list[Manifest], tags=["apps"])
async def app_versions(
    request: Request, principal: CurrentPrincipal, slug: str, tenant_id: uuid.UUID | None = None
) -> Any:
    async with _kit(request).sessions() as session:
        tid, operator = await service.reader_tenant(session, principal, tenant_id)
        items = await service.list_apps(session, tid, operator, slug)
    if not items:
        raise NotFound(f"no app {slug!r}", code="app_not_found")
    return items


@router.get("/manifests/{manifest_id}", response_model=Manifest, tags=["apps"])
async def get_manifest(
    request: Request, principal: CurrentPrincipal, manifest_id: uuid.UUID, tenant_id: uuid.UUID | None = None
) -> Any:
    async with _kit(request).sessions() as session:
        tid, operator = await service.reader_tenant(session, principal, tenant_id)
        return await service.get_manifest(session, manifest_id, tid, operator)


async def _manifest_change(request: Request, manifest_id: uuid.UUID, fn: Any) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        view = await fn(session)
    return {**view, "artifact_state": await _artifact_state(request, view["artifact_id"])}


@router.post(
    "/manifests/{manifest_id}/activate",
    response_model=Manifest,
    tags=["apps"],
    openapi_extra=iam.action_doc("catalog.app.register"),
)
async def activate(
    request: Request,
    manifest_id: uuid.UUID,
    principal: CurrentPrincipal,
    body: Reason | None = None,
    if_match: Annotated[str | None, Header()] = None,
) -> Any:
    """Offer the version to entitled tenants; refused unless its artifact is active."""
    expected = expected_version(if_match)
    return await _manifest_change(
        request,
        manifest_id,
        lambda s: service.set_manifest_active(
            s, principal, manifest_id, active=True, reason=(body.reason if body else ""), expected_revision=expected
        ),
    )


@router.post(
    "/manifests/{manifest_id}/deactivate",
    response_model=Manifest,
    tags=["apps"],
    openapi_extra=iam.action_doc("catalog.app.register"),
)
async def deactivate(
    request: Request,
    manifest_id: uuid.UUID,
    principal: CurrentPrincipal,
    body: Reason | None = None,
    if_match: Annotated[str | None, Header()] = None,
) -> Any:
    expected = expected_version(if_match)
    return await _manifest_change(
        request,
        manifest_id,
        lambda s: service.set_manifest_active(
            s, principal, manifest_id, active=False, reason=(body.reason if body else ""), expected_revision=expected
        ),
    )


@router.post(
    "/manifests/{manifest_id}/deprecate",
    response_model=Manifest,
    tags=["apps"],
    openapi_extra=iam.action_doc("catalog.app.register"),
)
async def deprecate(request: Request, manifest_id: uuid.UUID, body: RequiredReason, principal: CurrentPrincipal) -> Any:
    """Existing instances continue; no new instance may use this version."""
    return await _manifest_change(
        request, manifest_id, lambda s: service.deprecate_manifest(s, principal, manifest_id, reason=body.reason)
    )


@router.post("/apps/{slug}/compatibility", response_model=CompatibilityVerdict, tags=["apps"])
async def compatibility(request: Request, slug: str, body: CompatibilityQuery, principal: CurrentPrincipal) -> Any:
    """Can this app (newest version offered, or `version`) run in an allocation of this shape, and may the
    tenant deploy it? Every unmet requirement is listed with a stable code."""
    async with _kit(request).sessions() as session:
        tid, _ = await service.reader_tenant(session, principal, body.tenant_id)
        return await service.check_compatibility(
            session,
            slug=slug,
            version=body.version,
            tenant_id=tid,
            shape=domain.AllocationShape(
                capacity_shape=body.capacity_shape,
                gpu_count=body.gpu_count,
                exclusive_node=body.exclusive_node,
                allocation_count=body.allocation_count,
            ),
        )


# ---------------------------------------------------------------------------------- entitlements


@router.post(
    "/entitlements",
    response_model=Entitlement,
    status_code=201,
    tags=["entitlements"],
    openapi_extra=iam.action_doc("catalog.entitlement.manage"),
)
async def grant(request: Request, body: EntitlementGrant, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.grant_entitlement(session, principal, tenant_id=body.tenant_id, app_slug=body.app_slug)


@router.post(
    "/entitlements/{entitlement_id}/revoke",
    response_model=Entitlement,
    tags=["entitlements"],
    openapi_extra=iam.action_doc("catalog.entitlement.manage"),
)
async def revoke(
    request: Request, entitlement_id: uuid.UUID, principal: CurrentPrincipal, body: Reason | None = None
) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.revoke_entitlement(session, principal, entitlement_id, reason=body.reason if body else "")


@router.get("/entitlements", response_model=list[Entitlement], tags=["entitlements"])
async def list_entitlements(request: Request, principal: CurrentPrincipal, tenant_id: uuid.UUID | None = None) -> Any:
    async with _kit(request).sessions() as session:
        tid, _ = await service.reader_tenant(session, principal, tenant_id)
        return await service.list_entitlements(session, tid)


# --------------------------------------------------------------------------------------- snapshot


@router.get("/snapshot/{entity}", tags=["admin"])
async def snapshot(
    request: Request,
    entity: Literal["manifests", "artifacts", "entitlements"],
    _: Annotated[Principal, Depends(require("platform.admin"))],
    after: uuid.UUID | None = None,
    limit: int = Query(500, ge=1, le=1000),
) -> Any:
    """Paged full state (the events' payloads), to bootstrap a projection only; never on a request path.
    Page with `after=<next>` until `next` is null."""
    async with _kit(request).sessions() as session:
        items, nxt = await service.snapshot(session, entity, after, limit)
    return {"items": items, "next": nxt}


# ------------------------------------------------------------------------------------------- seed


@router.post("/admin/seed", tags=["admin"], openapi_extra=iam.action_doc("catalog.app.register"))
async def seed_catalog(request: Request, body: SeedRequest, principal: CurrentPrincipal) -> Any:
    """Operator: push the seed apps' placeholder artifacts to `registry` and register, verify, promote
    and entitle them (slurm-reference, jupyter, vllm, rke2-self-managed). Idempotent."""
    await _authorized(request, principal, "catalog.app.register")
    try:
        return await seed.seed_catalog(
            _kit(request).sessions, _registry(request), principal, registry=body.registry, tenant_ids=body.tenant_ids
        )
    except TrustError as exc:
        raise _trust_problem(exc) from None
