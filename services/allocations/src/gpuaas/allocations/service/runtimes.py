"""Runtime images: a projection of the catalog topic (manifests of kind `runtime` and their artifacts)
and the resolution of an allocation's `runtime` against it.

The catalog owns the lifecycle gates and the trust checks against the registry; allocations only
reads what the catalog published, in the consumer's transaction, so a create never calls catalog. A
runtime is offered for a new allocation when its manifest is active and not deprecated and its artifact
is `active` (or `canary` with the tenant among its canary tenants), the same rule catalog applies to apps.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import domain
from gpuaas.allocations.models import catalog_artifacts, catalog_runtimes
from gpuaas.contracts.events import catalog as catalog_events
from gpuaas.contracts.events.allocations import RuntimeRef
from gpuaas.kit.errors import Unprocessable


async def _upsert(session: AsyncSession, table: Any, key: str, counter: str, values: dict[str, Any]) -> None:
    """Insert, or update when the event is newer than the row (a replay never rolls state back)."""
    stmt = pg_insert(table).values(values)
    await session.execute(
        stmt.on_conflict_do_update(
            index_elements=[key],
            set_={k: stmt.excluded[k] for k in values if k != key},
            where=getattr(table.c, counter) < getattr(stmt.excluded, counter),
        )
    )


async def record_runtime_manifest(
    session: AsyncSession, manifest: catalog_events.AppManifestState, *, deprecated: bool
) -> None:
    if manifest.artifact_kind != catalog_events.AppArtifactKind.runtime:
        return
    await _upsert(
        session,
        catalog_runtimes,
        "manifest_id",
        "revision",
        {
            "manifest_id": manifest.manifest_id,
            "slug": manifest.slug,
            "app_version": manifest.version,
            "display_name": manifest.display_name,
            "active": manifest.active,
            "deprecated": manifest.deprecated or deprecated,
            "artifact_ref": manifest.artifact_ref,
            "artifact_id": manifest.artifact_id,
            "revision": manifest.revision,
        },
    )


async def record_artifact(session: AsyncSession, artifact: catalog_events.ArtifactState) -> None:
    if artifact.kind != catalog_events.ArtifactKind.oci:
        return
    await _upsert(
        session,
        catalog_artifacts,
        "artifact_id",
        "version",
        {
            "artifact_id": artifact.artifact_id,
            "ref": artifact.ref,
            "digest": artifact.digest,
            "state": str(artifact.state),
            "canary_tenants": [str(t) for t in artifact.canary_tenants],
            "version": artifact.version,
        },
    )


def _why_not_offered(row: Any, tenant_id: uuid.UUID | None) -> str | None:
    """None when the runtime may be chosen for a new allocation of this tenant, else why not."""
    if row.state is None:
        return "its artifact is not known yet"
    if row.deprecated:
        return "it is deprecated"
    if row.state == catalog_events.ArtifactLifecycle.active and row.active:
        return None
    if row.state == catalog_events.ArtifactLifecycle.canary and str(tenant_id) in set(row.canary_tenants):
        return None
    return f"its artifact is {row.state}" if row.state != catalog_events.ArtifactLifecycle.active else "not offered"


def _joined() -> Any:
    return select(
        catalog_runtimes.c.slug,
        catalog_runtimes.c.app_version,
        catalog_runtimes.c.display_name,
        catalog_runtimes.c.active,
        catalog_runtimes.c.deprecated,
        catalog_runtimes.c.artifact_ref,
        catalog_artifacts.c.digest,
        catalog_artifacts.c.state,
        catalog_artifacts.c.canary_tenants,
    ).outerjoin(catalog_artifacts, catalog_artifacts.c.artifact_id == catalog_runtimes.c.artifact_id)


def _ref(row: Any) -> RuntimeRef:
    return RuntimeRef(slug=row.slug, version=row.app_version, image=row.artifact_ref, digest=row.digest)


async def resolve_runtime(session: AsyncSession, value: str, tenant_id: uuid.UUID | None) -> RuntimeRef:
    """The runtime `value` names (slug: its newest offered version; slug@version; sha256 digest), or 422
    `runtime_unavailable` saying why (unknown, retired, deprecated, not active)."""
    spec = domain.parse_runtime_spec(value)
    q = _joined()
    if spec.digest:
        q = q.where(catalog_artifacts.c.digest == spec.digest)
    else:
        q = q.where(catalog_runtimes.c.slug == spec.slug)
        if spec.version:
            q = q.where(catalog_runtimes.c.app_version == spec.version)
    rows = (await session.execute(q)).all()
    offered = [r for r in rows if _why_not_offered(r, tenant_id) is None]
    if offered:
        return _ref(max(offered, key=lambda r: domain.version_key(r.app_version)))
    if not rows:
        detail = f"no runtime {value!r} is known to the catalog"
    else:
        newest = max(rows, key=lambda r: domain.version_key(r.app_version))
        detail = f"runtime {newest.slug} {newest.app_version} cannot be chosen: {_why_not_offered(newest, tenant_id)}"
    raise Unprocessable(detail, code="runtime_unavailable", runtime=value)


async def offered_runtimes(session: AsyncSession, tenant_id: uuid.UUID | None) -> list[dict[str, Any]]:
    """Every runtime version a new allocation of this tenant may choose, newest first per slug."""
    rows = [r for r in (await session.execute(_joined())).all() if _why_not_offered(r, tenant_id) is None]
    by_slug: dict[str, list[Any]] = {}
    for r in rows:
        by_slug.setdefault(r.slug, []).append(r)
    out = []
    for slug in sorted(by_slug):
        for r in sorted(by_slug[slug], key=lambda r: domain.version_key(r.app_version), reverse=True):
            out.append({**_ref(r).model_dump(), "display_name": r.display_name, "state": r.state})
    return out
