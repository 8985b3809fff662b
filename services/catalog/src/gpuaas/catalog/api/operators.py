"""For platform operators: granting and revoking entitlements, snapshot pages for projections, and
seeding the catalog with its placeholder apps."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query

from gpuaas.catalog import seed, service
from gpuaas.catalog.api.schemas import Entitlement, EntitlementGrant, Reason, SeedRequest
from gpuaas.catalog.runtime import CatalogRuntime
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal, Principal
from gpuaas.kit.iam import action_doc, require

router = APIRouter()


@router.post(
    "/entitlements",
    response_model=Entitlement,
    status_code=201,
    tags=["entitlements"],
    openapi_extra=action_doc("catalog.entitlement.manage"),
)
async def grant(kit: Kit, body: EntitlementGrant, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        return await service.grant_entitlement(session, principal, tenant_id=body.tenant_id, app_slug=body.app_slug)


@router.post(
    "/entitlements/{entitlement_id}/revoke",
    response_model=Entitlement,
    tags=["entitlements"],
    openapi_extra=action_doc("catalog.entitlement.manage"),
)
async def revoke(kit: Kit, entitlement_id: uuid.UUID, principal: CurrentPrincipal, body: Reason | None = None) -> Any:
    async with kit.sessions() as session, session.begin():
        return await service.revoke_entitlement(session, principal, entitlement_id, reason=body.reason if body else "")


@router.get("/snapshot/{entity}", tags=["admin"])
async def snapshot(
    kit: Kit,
    entity: Literal["manifests", "artifacts", "entitlements"],
    _: Annotated[Principal, Depends(require("platform.admin"))],
    after: uuid.UUID | None = None,
    limit: int = Query(500, ge=1, le=1000),
) -> Any:
    """Paged full state (the events' payloads), to bootstrap a projection only; never on a request path.
    Page with `after=<next>` until `next` is null."""
    async with kit.sessions() as session:
        page = await service.snapshot(session, entity, after, limit)
    return {"items": [state.model_dump(mode="json") for state in page.items], "next": page.next}


@router.post("/admin/seed", tags=["admin"], openapi_extra=action_doc("catalog.app.register"))
async def seed_catalog(kit: Kit, body: SeedRequest, principal: CurrentPrincipal) -> Any:
    """Operator: push the seed apps' placeholder artifacts to `registry` and register, verify, promote
    and entitle them (slurm-reference, jupyter, vllm, rke2-self-managed). Idempotent."""
    return await seed.seed_catalog(
        kit.sessions,
        kit.state_as(CatalogRuntime).registry,
        principal,
        registry=body.registry,
        tenant_ids=body.tenant_ids,
    )
