"""Catalog browsing, for tenants' users and service accounts (and operators reading as a tenant):
the manifest schemas, apps and versions offered, one manifest, compatibility, entitlements."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Query

from gpuaas.catalog import domain, service
from gpuaas.catalog.api.schemas import SLUG, CompatibilityQuery, CompatibilityVerdict, Entitlement, Manifest
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.kit.errors import NotFound

router = APIRouter()


@router.get("/schemas/manifest", tags=["apps"])
async def manifest_schema(_: CurrentPrincipal) -> dict[str, Any]:
    return domain.MANIFEST_SCHEMA


@router.get("/schemas/launchable-profile", tags=["apps"])
async def launchable_profile_schema(_: CurrentPrincipal) -> dict[str, Any]:
    return domain.LAUNCHABLE_PROFILE_SCHEMA


@router.get("/apps", response_model=list[Manifest], tags=["apps"])
async def list_apps(
    kit: Kit,
    principal: CurrentPrincipal,
    tenant_id: uuid.UUID | None = None,
    slug: str | None = Query(None, pattern=SLUG),
) -> Any:
    """A tenant sees the entitled apps' versions offered to it (active, or a canary exposed to it);
    operators without `tenant_id` see every manifest; with it, what that tenant sees."""
    async with kit.sessions() as session:
        tid, operator = await service.reader_tenant(session, principal, tenant_id)
        return await service.list_apps(session, tid, operator, slug)


@router.get("/apps/{slug}", response_model=list[Manifest], tags=["apps"])
async def app_versions(kit: Kit, principal: CurrentPrincipal, slug: str, tenant_id: uuid.UUID | None = None) -> Any:
    async with kit.sessions() as session:
        tid, operator = await service.reader_tenant(session, principal, tenant_id)
        items = await service.list_apps(session, tid, operator, slug)
    if not items:
        raise NotFound(f"no app {slug!r}", code="app_not_found")
    return items


@router.get("/manifests/{manifest_id}", response_model=Manifest, tags=["apps"])
async def get_manifest(
    kit: Kit, principal: CurrentPrincipal, manifest_id: uuid.UUID, tenant_id: uuid.UUID | None = None
) -> Any:
    async with kit.sessions() as session:
        tid, operator = await service.reader_tenant(session, principal, tenant_id)
        return await service.get_manifest(session, manifest_id, tid, operator)


@router.post("/apps/{slug}/compatibility", response_model=CompatibilityVerdict, tags=["apps"])
async def compatibility(kit: Kit, slug: str, body: CompatibilityQuery, principal: CurrentPrincipal) -> Any:
    """Can this app (newest version offered, or `version`) run in an allocation of this shape, and may the
    tenant deploy it? Every unmet requirement is listed with a stable code."""
    async with kit.sessions() as session:
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


@router.get("/entitlements", response_model=list[Entitlement], tags=["entitlements"])
async def list_entitlements(kit: Kit, principal: CurrentPrincipal, tenant_id: uuid.UUID | None = None) -> Any:
    async with kit.sessions() as session:
        tid, _ = await service.reader_tenant(session, principal, tenant_id)
        return await service.list_entitlements(session, tid)
