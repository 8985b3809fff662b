"""Entitlement use cases: which tenants may deploy which apps. Each runs in the caller's one transaction."""

from __future__ import annotations

import uuid

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.catalog.models import entitlements, manifests
from gpuaas.catalog.service.common import entitlement_state, now, publish, require_tenants, row_of
from gpuaas.contracts import new_event_id
from gpuaas.contracts.events import catalog as catalog_events
from gpuaas.contracts.events.catalog import EntitlementState
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound


async def grant_entitlement(
    session: AsyncSession, principal: Principal, *, tenant_id: uuid.UUID, app_slug: str
) -> EntitlementState:
    """Entitle a tenant to an app (a revoked entitlement is granted again, keeping its id)."""
    await iam.authorize(session, principal, "catalog.entitlement.manage")
    await require_tenants(session, [tenant_id])
    if not (await session.execute(select(manifests.c.manifest_id).where(manifests.c.slug == app_slug))).first():
        raise NotFound(f"no app {app_slug!r} is registered", code="app_not_found")
    row = (
        await session.execute(
            select(entitlements)
            .where(entitlements.c.tenant_id == tenant_id, entitlements.c.app_slug == app_slug)
            .with_for_update()
        )
    ).first()
    granted_at = now()
    if row is not None and row.status == "granted":
        raise Conflict(f"the tenant is already entitled to {app_slug}", code="already_entitled")
    if row is None:
        entitlement_id = new_event_id()
        await session.execute(
            insert(entitlements).values(
                entitlement_id=entitlement_id,
                tenant_id=tenant_id,
                app_slug=app_slug,
                status="granted",
                granted_at=granted_at,
            )
        )
    else:
        entitlement_id = row.entitlement_id
        await session.execute(
            update(entitlements)
            .where(entitlements.c.entitlement_id == entitlement_id)
            .values(status="granted", granted_at=granted_at, revoked_at=None, version=row.version + 1)
        )
    state = entitlement_state(await row_of(session, entitlements, "entitlement_id", entitlement_id))
    await publish(
        session,
        principal,
        catalog_events.EntitlementGranted,
        state,
        action="catalog.entitlement.grant",
        resource_type="entitlement",
        resource_id=entitlement_id,
        tenant_id=tenant_id,
        after=state.model_dump(mode="json"),
    )
    return state


async def revoke_entitlement(
    session: AsyncSession, principal: Principal, entitlement_id: uuid.UUID, *, reason: str
) -> EntitlementState:
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
        .values(status="revoked", revoked_at=now(), version=row.version + 1)
    )
    state = entitlement_state(await row_of(session, entitlements, "entitlement_id", entitlement_id))
    await publish(
        session,
        principal,
        catalog_events.EntitlementRevoked,
        state,
        action="catalog.entitlement.revoke",
        resource_type="entitlement",
        resource_id=entitlement_id,
        tenant_id=row.tenant_id,
        before={"status": "granted"},
        after={"status": "revoked"},
        reason=reason or None,
    )
    return state


async def list_entitlements(session: AsyncSession, tenant_id: uuid.UUID | None) -> list[EntitlementState]:
    query = select(entitlements).order_by(entitlements.c.app_slug)
    if tenant_id is not None:
        query = query.where(entitlements.c.tenant_id == tenant_id)
    return [entitlement_state(row) for row in await session.execute(query)]


async def entitled_slugs(session: AsyncSession, tenant_id: uuid.UUID) -> set[str]:
    rows = await session.execute(
        select(entitlements.c.app_slug).where(entitlements.c.tenant_id == tenant_id, entitlements.c.status == "granted")
    )
    return {row[0] for row in rows}
