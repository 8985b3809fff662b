"""Tenants and projects administration: tenants, projects, tenant and project members, memberships."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Response
from fastapi.types import DecoratedCallable

from gpuaas.identity.api.deps import action
from gpuaas.identity.api.schemas import Granted, MemberAdd, Membership, Project, ProjectCreate, Tenant, TenantCreate
from gpuaas.identity.service import tenants, users, views
from gpuaas.kit.app import Kit, KitRuntime
from gpuaas.kit.auth import CurrentPrincipal, Principal

router = APIRouter()


@router.post("/tenants", response_model=Tenant, status_code=201, tags=["tenants"], **action("identity.tenant.create"))
async def create_tenant(kit: Kit, body: TenantCreate, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        return await tenants.create_tenant(session, principal, slug=body.slug, name=body.name)


@router.get("/tenants", response_model=list[Tenant], tags=["tenants"])
async def list_tenants(kit: Kit, principal: CurrentPrincipal) -> Any:
    """Operators: every tenant; everyone else: the tenants they are a member of."""
    async with kit.sessions() as session:
        return await tenants.list_tenants(session, principal)


@router.get("/tenants/{tenant_id}", response_model=Tenant, tags=["tenants"], **action("identity.tenant.read"))
async def get_tenant(kit: Kit, tenant_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session:
        return await tenants.get_tenant(session, principal, tenant_id)


@router.post(
    "/tenants/{tenant_id}/projects",
    response_model=Project,
    status_code=201,
    tags=["projects"],
    **action("identity.project.create"),
)
async def create_project(kit: Kit, tenant_id: uuid.UUID, body: ProjectCreate, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        return await tenants.create_project(session, principal, tenant_id=tenant_id, name=body.name)


@router.get("/tenants/{tenant_id}/projects", response_model=list[Project], tags=["projects"])
async def list_projects(kit: Kit, tenant_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    """Tenant admins and operators see every project of the tenant; other members their own."""
    async with kit.sessions() as session:
        return await tenants.list_projects(session, principal, tenant_id)


@router.get("/projects/{project_id}", response_model=Project, tags=["projects"], **action("identity.project.read"))
async def get_project(kit: Kit, project_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session:
        return await tenants.get_project(session, principal, project_id)


def _adds_member(path: str, tag: str) -> Callable[[DecoratedCallable], DecoratedCallable]:
    return router.post(path, response_model=Granted, status_code=201, tags=[tag], **action("identity.member.manage"))


async def _add_member(
    kit: KitRuntime,
    principal: Principal,
    body: MemberAdd,
    add: Callable[..., Awaitable[views.Granted]],
    **scope: uuid.UUID,
) -> views.Granted:
    """Add a member with the use case of its scope (`tenant_id=` or `project_id=`)."""
    async with kit.sessions() as session, session.begin():
        return await add(session, principal, user_id=body.user_id, role=body.role, **scope)


@_adds_member("/tenants/{tenant_id}/members", "users")
async def add_tenant_member(kit: Kit, tenant_id: uuid.UUID, body: MemberAdd, principal: CurrentPrincipal) -> Any:
    return await _add_member(kit, principal, body, users.add_tenant_member, tenant_id=tenant_id)


@_adds_member("/projects/{project_id}/members", "projects")
async def add_member(kit: Kit, project_id: uuid.UUID, body: MemberAdd, principal: CurrentPrincipal) -> Any:
    return await _add_member(kit, principal, body, users.add_project_member, project_id=project_id)


@router.get(
    "/projects/{project_id}/members",
    response_model=list[Membership],
    tags=["projects"],
    **action("identity.member.read"),
)
async def list_members(kit: Kit, project_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session:
        return await users.list_project_members(session, principal, project_id)


@router.delete("/memberships/{membership_id}", status_code=204, tags=["projects"], **action("identity.member.manage"))
async def revoke_membership(kit: Kit, membership_id: uuid.UUID, principal: CurrentPrincipal) -> Response:
    """Revoke a membership; every service denies the access as soon as it applies the event."""
    async with kit.sessions() as session, session.begin():
        await users.revoke_membership(session, principal, membership_id)
    return Response(status_code=204)
