"""Identity's HTTP surface (thin: validation here, rules in service.py)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Form, Query, Request, Response
from pydantic import BaseModel, EmailStr, Field
from sqlalchemy import func, select

from gpuaas.contracts.enums import Role
from gpuaas.identity import keys, service
from gpuaas.identity.models import audit_records
from gpuaas.kit import iam
from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.kit.errors import Forbidden, Unprocessable

router = APIRouter()
SLUG = r"^[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?$"


class TokenResponse(BaseModel):
    access_token: str
    token_type: str
    expires_in: int


class TenantCreate(BaseModel):
    slug: str = Field(pattern=SLUG, description="lowercase letters, digits and dashes")
    name: str = Field(min_length=1, max_length=200)


class Tenant(BaseModel):
    tenant_id: uuid.UUID
    slug: str
    name: str
    status: str


class ProjectCreate(BaseModel):
    name: str = Field(min_length=1, max_length=100)


class Project(BaseModel):
    project_id: uuid.UUID
    tenant_id: uuid.UUID
    name: str
    archived: bool


class UserCreate(BaseModel):
    email: EmailStr
    password: str = Field(min_length=12, max_length=256)
    display_name: str = Field("", max_length=200)
    role: Role | None = Role.project_member


class UserCreated(BaseModel):
    user_id: uuid.UUID
    email: str
    tenant_id: uuid.UUID
    membership_id: uuid.UUID | None


class MemberAdd(BaseModel):
    user_id: uuid.UUID
    role: Role


class Membership(BaseModel):
    membership_id: uuid.UUID
    user_id: uuid.UUID
    project_id: uuid.UUID
    role: Role


class AuditEntry(BaseModel):
    event_id: uuid.UUID
    occurred_at: datetime
    service: str
    actor_kind: str
    actor_id: str
    tenant_id: uuid.UUID | None
    project_id: uuid.UUID | None
    action: str
    resource_type: str
    resource_id: str
    outcome: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    reason: str | None
    correlation_id: str | None


class AuditPage(BaseModel):
    items: list[AuditEntry]
    total: int


def _kit(request: Request) -> Any:
    return request.app.state.kit


@router.get("/.well-known/jwks.json", tags=["oidc"])
async def jwks(request: Request, response: Response) -> dict[str, Any]:
    response.headers["Cache-Control"] = "public, max-age=60"
    async with _kit(request).sessions() as session:
        return await keys.jwks(session, _kit(request).settings.access_token_ttl_s)


@router.get("/.well-known/openid-configuration", tags=["oidc"])
async def discovery(request: Request) -> dict[str, Any]:
    issuer = _kit(request).settings.public_url
    return {
        "issuer": issuer,
        "token_endpoint": f"{issuer}/auth/token",
        "jwks_uri": f"{issuer}/.well-known/jwks.json",
        "grant_types_supported": ["password"],
        "id_token_signing_alg_values_supported": ["ES256"],
        "token_endpoint_auth_methods_supported": ["none"],
        "response_types_supported": [],
        "subject_types_supported": ["public"],
    }


@router.post("/auth/token", response_model=TokenResponse, tags=["auth"])
async def token(
    request: Request,
    grant_type: Annotated[str, Form()],
    username: Annotated[str, Form(max_length=320)],
    password: Annotated[str, Form(max_length=256)],
) -> Any:
    """OAuth2 password grant for local users (the full OIDC provider replaces this surface)."""
    if grant_type != "password":
        raise Unprocessable("only grant_type=password is supported here", code="unsupported_grant_type")
    kit = _kit(request)
    async with kit.sessions() as session:
        return await service.login(
            session,
            email=username,
            password=password,
            issuer=kit.settings.public_url,
            ttl_s=kit.settings.access_token_ttl_s,
        )


@router.post("/tenants", response_model=Tenant, status_code=201, tags=["tenants"])
async def create_tenant(request: Request, body: TenantCreate, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.create_tenant(session, principal, slug=body.slug, name=body.name)


@router.post("/tenants/{tenant_id}/projects", response_model=Project, status_code=201, tags=["projects"])
async def create_project(
    request: Request, tenant_id: uuid.UUID, body: ProjectCreate, principal: CurrentPrincipal
) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.create_project(session, principal, tenant_id=tenant_id, name=body.name)


@router.post("/tenants/{tenant_id}/users", response_model=UserCreated, status_code=201, tags=["users"])
async def create_user(request: Request, tenant_id: uuid.UUID, body: UserCreate, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.create_tenant_user(
            session,
            principal,
            tenant_id=tenant_id,
            email=body.email,
            password=body.password,
            display_name=body.display_name,
            role=body.role,
        )


@router.post("/projects/{project_id}/members", response_model=Membership, status_code=201, tags=["projects"])
async def add_member(request: Request, project_id: uuid.UUID, body: MemberAdd, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.add_project_member(
            session, principal, project_id=project_id, user_id=body.user_id, role=body.role
        )


@router.delete("/memberships/{membership_id}", status_code=204, tags=["projects"])
async def revoke_membership(request: Request, membership_id: uuid.UUID, principal: CurrentPrincipal) -> Response:
    async with _kit(request).sessions() as session, session.begin():
        await service.revoke_membership(session, principal, membership_id)
    return Response(status_code=204)


@router.get("/audit", response_model=AuditPage, tags=["audit"])
async def list_audit(
    request: Request,
    principal: CurrentPrincipal,
    tenant_id: uuid.UUID | None = None,
    action: str | None = Query(None, max_length=100),
    resource_id: str | None = Query(None, max_length=200),
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0),
) -> Any:
    """Operators see every record; tenant admins only their tenant's (pass `tenant_id`)."""
    async with _kit(request).sessions() as session:
        if not await iam.is_platform_admin(session, principal):
            if tenant_id is None:
                raise Forbidden("pass the tenant_id whose audit trail you administer", code="tenant_required")
            await iam.authorize(session, principal, "identity.audit.read", tenant_id=tenant_id)
        where = []
        if tenant_id is not None:
            where.append(audit_records.c.tenant_id == tenant_id)
        if action:
            where.append(audit_records.c.action == action)
        if resource_id:
            where.append(audit_records.c.resource_id == resource_id)
        rows = await session.execute(
            select(audit_records).where(*where).order_by(audit_records.c.occurred_at.desc()).limit(limit).offset(offset)
        )
        total = (await session.execute(select(func.count()).select_from(audit_records).where(*where))).scalar_one()
    return {"items": [dict(r._mapping) for r in rows], "total": total}
