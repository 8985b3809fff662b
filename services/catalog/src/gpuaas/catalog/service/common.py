"""What the catalog's use cases share: contract states and views built from rows, row locks, the
clock, the check list, and the event + audit pair every change ends with."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Row, Table, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.catalog import SERVICE
from gpuaas.catalog.models import artifacts, instance_digests, manifests
from gpuaas.catalog.oci import TrustError
from gpuaas.catalog.service.views import Artifact, Manifest
from gpuaas.contracts.envelope import Event, Payload
from gpuaas.contracts.events import catalog as catalog_events
from gpuaas.kit import audit
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import NotFound, Problem, Unprocessable
from gpuaas.kit.outbox import add_event
from gpuaas.kit.tables import iam_tenants

# Instances in these states no longer hold their artifact digest (the retire gate).
RELEASED_INSTANCE_STATES = ("decommissioned",)


def now() -> datetime:
    return datetime.now(UTC)


def trust_problem(exc: TrustError) -> Problem:
    """A registry verdict as the client sees it: 422 refused content, else the registry's failure."""
    title = "Artifact refused" if exc.status == 422 else "Registry unavailable"
    return Problem(exc.detail, code=exc.code, status=exc.status, title=title)


# ------------------------------------------------------------------------------- states and views


def _mapping(row: Row[Any] | Mapping[str, Any]) -> Mapping[Any, Any]:
    return row._mapping if isinstance(row, Row) else row


def _columns(r: Mapping[Any, Any], *names: str) -> dict[str, Any]:
    """The named columns as they are stored (those a state or view takes unchanged)."""
    return {name: r[name] for name in names}


def artifact_state(row: Row[Any] | Mapping[str, Any]) -> catalog_events.ArtifactState:
    r = _mapping(row)
    return catalog_events.ArtifactState(
        **_columns(r, "artifact_id", "ref", "digest", "media_type", "size_bytes", "signature_verified", "version"),
        kind=catalog_events.ArtifactKind(r["kind"]),
        state=catalog_events.ArtifactLifecycle(r["state"]),
        canary_tenants=[uuid.UUID(str(t)) for t in r["canary_tenants"]],
        checks=[catalog_events.ArtifactCheck(**c) for c in r["checks"]],
    )


def manifest_state(row: Row[Any] | Mapping[str, Any]) -> catalog_events.AppManifestState:
    r = _mapping(row)
    return catalog_events.AppManifestState(
        **_columns(
            r,
            "manifest_id",
            "slug",
            "display_name",
            "description",
            "version",
            "runtime_version",
            "artifact_ref",
            "artifact_id",
            "runtime_profile",
            "inputs",
            "active",
            "deprecated",
            "revision",
        ),
        artifact_kind=catalog_events.AppArtifactKind(r["artifact_kind"]),
        compatibility=catalog_events.Compatibility(**r["compatibility"]),
        roles=[catalog_events.AppRole(**x) for x in r["roles"]],
    )


def entitlement_state(row: Row[Any] | Mapping[str, Any]) -> catalog_events.EntitlementState:
    r = _mapping(row)
    return catalog_events.EntitlementState(
        **_columns(r, "entitlement_id", "tenant_id", "app_slug", "status", "granted_at", "revoked_at", "version")
    )


def artifact_view(row: Row[Any]) -> Artifact:
    r = row._mapping
    return Artifact.model_validate(
        {
            **artifact_state(row).model_dump(mode="json"),
            **_columns(r, "registry", "repository", "artifact_type", "signature_detail", "created_at", "updated_at"),
        }
    )


def manifest_view(row: Row[Any], artifact_state: str, *, canary: bool = False) -> Manifest:
    """A manifest row as served, with the state of its artifact (and, for a tenant, whether it is a canary)."""
    r = row._mapping
    return Manifest.model_validate(
        {
            **manifest_state(row).model_dump(mode="json"),
            **_columns(r, "created_at", "updated_at"),
            "artifact_state": artifact_state,
            "canary": canary,
        }
    )


# ------------------------------------------------------------------------------------------- rows


async def row_of(session: AsyncSession, table: Table, key: str, value: uuid.UUID) -> Row[Any]:
    """The row as it is now in this transaction (after an insert or update of it)."""
    return (await session.execute(select(table).where(table.c[key] == value))).one()


async def artifact_for_update(session: AsyncSession, artifact_id: uuid.UUID) -> Row[Any]:
    row = (
        await session.execute(select(artifacts).where(artifacts.c.artifact_id == artifact_id).with_for_update())
    ).first()
    if row is None:
        raise NotFound("artifact not found", code="artifact_not_found")
    return row


async def manifest_for_update(session: AsyncSession, manifest_id: uuid.UUID) -> Row[Any]:
    row = (
        await session.execute(select(manifests).where(manifests.c.manifest_id == manifest_id).with_for_update())
    ).first()
    if row is None:
        raise NotFound("app manifest not found", code="manifest_not_found")
    return row


async def manifests_with_artifacts(session: AsyncSession, where: list[Any]) -> list[tuple[Row[Any], dict[str, Any]]]:
    """Manifests (oldest first per slug) with what the offer rules need of their artifact."""
    query = (
        select(manifests, artifacts.c.state.label("artifact_state"), artifacts.c.canary_tenants)
        .join(artifacts, artifacts.c.artifact_id == manifests.c.artifact_id)
        .where(*where)
        .order_by(manifests.c.slug, manifests.c.created_at)
    )
    return [
        (row, {"state": row.artifact_state, "canary_tenants": row.canary_tenants})
        for row in await session.execute(query)
    ]


async def current_manifest_view(session: AsyncSession, manifest_id: uuid.UUID) -> Manifest:
    """The manifest as it is now in this transaction, with its artifact's state."""
    ((row, artifact),) = await manifests_with_artifacts(session, [manifests.c.manifest_id == manifest_id])
    return manifest_view(row, artifact["state"])


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


async def require_tenants(session: AsyncSession, tenant_ids: list[uuid.UUID]) -> None:
    for tenant_id in tenant_ids:
        known = await session.execute(select(iam_tenants.c.tenant_id).where(iam_tenants.c.tenant_id == tenant_id))
        if known.first() is None:
            raise Unprocessable(f"tenant {tenant_id} is unknown", code="tenant_unknown")


# ----------------------------------------------------------------------------------------- checks


def check_record(name: str, passed: bool, detail: str) -> dict[str, Any]:
    """A check as stored in the artifact's `checks` column (JSON)."""
    return {"name": name, "passed": passed, "recorded_at": now().isoformat(), "detail": detail[:2000]}


def with_check(checks: list[dict[str, Any]], check: dict[str, Any]) -> list[dict[str, Any]]:
    """Keep the latest result per check name (earlier ones stay in the audit trail)."""
    return [c for c in checks if c["name"] != check["name"]] + [check]


# ------------------------------------------------------------------------------- event and audit


async def publish(
    session: AsyncSession,
    principal: Principal,
    event: type[Event],
    data: Payload,
    *,
    action: str,
    resource_type: str,
    resource_id: uuid.UUID,
    **audit_fields: Any,
) -> None:
    """Stage the change's event in the outbox and its audit record, in the caller's transaction."""
    await add_event(session, event.build(data=data, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action=action,
        resource_type=resource_type,
        resource_id=resource_id,
        **audit_fields,
    )
