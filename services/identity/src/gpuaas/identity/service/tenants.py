"""Tenants and their projects: creation (operators, tenant admins) and the reads each caller may see.

Answers are the contract states (`TenantState`, `ProjectState`): what the events carry.
"""

from __future__ import annotations

import uuid

from sqlalchemy import Row, insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import new_event_id
from gpuaas.contracts.events import identity as identity_events
from gpuaas.identity.models import memberships, projects, tenants
from gpuaas.identity.service.common import record_change
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound


def _tenant(r: Row) -> identity_events.TenantState:
    return identity_events.TenantState(tenant_id=r.tenant_id, slug=r.slug, name=r.name, status=r.status)


def _project(r: Row) -> identity_events.ProjectState:
    return identity_events.ProjectState(
        project_id=r.project_id, tenant_id=r.tenant_id, name=r.name, archived=r.archived
    )


async def create_tenant(
    session: AsyncSession, principal: Principal, *, slug: str, name: str
) -> identity_events.TenantState:
    await iam.authorize(session, principal, "identity.tenant.create")
    if (await session.execute(select(tenants.c.tenant_id).where(tenants.c.slug == slug))).first():
        raise Conflict(f"the tenant slug {slug!r} is taken", code="tenant_slug_taken")
    tenant_id = new_event_id()
    await session.execute(insert(tenants).values(tenant_id=tenant_id, slug=slug, name=name, status="active"))
    state = identity_events.TenantState(tenant_id=tenant_id, slug=slug, name=name)
    await record_change(
        session,
        identity_events.TenantCreated,
        state,
        actor=principal.actor,
        action="identity.tenant.create",
        resource_type="tenant",
        resource_id=tenant_id,
        tenant_id=tenant_id,
    )
    return state


async def create_project(
    session: AsyncSession, principal: Principal, *, tenant_id: uuid.UUID, name: str
) -> identity_events.ProjectState:
    await iam.authorize(session, principal, "identity.project.create", tenant_id=tenant_id)
    taken = await session.execute(
        select(projects.c.project_id).where(projects.c.tenant_id == tenant_id, projects.c.name == name)
    )
    if taken.first():
        raise Conflict(f"a project named {name!r} exists in this tenant", code="project_name_taken")
    project_id = new_event_id()
    await session.execute(insert(projects).values(project_id=project_id, tenant_id=tenant_id, name=name))
    state = identity_events.ProjectState(project_id=project_id, tenant_id=tenant_id, name=name)
    await record_change(
        session,
        identity_events.ProjectCreated,
        state,
        actor=principal.actor,
        action="identity.project.create",
        resource_type="project",
        resource_id=project_id,
        tenant_id=tenant_id,
        project_id=project_id,
    )
    return state


async def list_tenants(session: AsyncSession, principal: Principal) -> list[identity_events.TenantState]:
    """Operators: every tenant; everyone else: the tenants they are a member of."""
    query = select(tenants).order_by(tenants.c.slug)
    if not await iam.is_platform_admin(session, principal):
        mine = select(memberships.c.tenant_id).where(
            memberships.c.user_id == principal.subject, memberships.c.revoked.is_(False)
        )
        query = query.where(tenants.c.tenant_id.in_(mine))
    return [_tenant(r) for r in await session.execute(query)]


async def get_tenant(session: AsyncSession, principal: Principal, tenant_id: uuid.UUID) -> identity_events.TenantState:
    await iam.authorize(session, principal, "identity.tenant.read", tenant_id=tenant_id)
    row = (await session.execute(select(tenants).where(tenants.c.tenant_id == tenant_id))).first()
    if row is None:
        raise NotFound("tenant not found", code="tenant_not_found")
    return _tenant(row)


async def list_projects(
    session: AsyncSession, principal: Principal, tenant_id: uuid.UUID
) -> list[identity_events.ProjectState]:
    """The tenant's projects the caller can see: all for tenant admins/operators, else their own."""
    visible = await iam.visible_project_ids(session, principal)
    if visible is not None:
        member = (
            await session.execute(
                select(memberships.c.membership_id).where(
                    memberships.c.user_id == principal.subject,
                    memberships.c.tenant_id == tenant_id,
                    memberships.c.revoked.is_(False),
                )
            )
        ).first()
        if member is None and principal.tenant_id != tenant_id:
            raise NotFound("tenant not found", code="not_found")
    query = select(projects).where(projects.c.tenant_id == tenant_id).order_by(projects.c.name)
    if visible is not None:
        query = query.where(projects.c.project_id.in_(visible or [uuid.UUID(int=0)]))
    return [_project(r) for r in await session.execute(query)]


async def get_project(
    session: AsyncSession, principal: Principal, project_id: uuid.UUID
) -> identity_events.ProjectState:
    await iam.authorize(session, principal, "identity.project.read", project_id=project_id)
    row = (await session.execute(select(projects).where(projects.c.project_id == project_id))).one()
    return _project(row)
