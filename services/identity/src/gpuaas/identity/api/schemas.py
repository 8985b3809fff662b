"""Request and response models of identity's API. The response models of what use cases answer as
view models are those view models (re-exported from service/views.py); the others shape contract
states (Tenant, Project, Idp) or documents (Discovery)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, EmailStr, Field

from gpuaas.contracts.enums import Role
from gpuaas.contracts.scalars import Name
from gpuaas.identity.service.views import (
    AuditEntry,
    AuditPage,
    DomainClaim,
    Granted,
    KeyRotation,
    Me,
    Membership,
    OAuthClient,
    ServiceAccount,
    ServiceAccountWithSecret,
    SessionInfo,
    TokenResponse,
    User,
    UserCreated,
    UserStatus,
)

SLUG = r"^[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?$"
DOMAIN = r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)+$"
__all__ = [
    "DOMAIN",
    "SLUG",
    "AuditEntry",
    "AuditPage",
    "Discovery",
    "DomainClaim",
    "Granted",
    "Idp",
    "IdpCreate",
    "KeyRotation",
    "Me",
    "MemberAdd",
    "Membership",
    "OAuthClient",
    "OAuthClientCreate",
    "PlatformAdminAdd",
    "PlatformUserCreate",
    "Project",
    "ProjectCreate",
    "ServiceAccount",
    "ServiceAccountCreate",
    "ServiceAccountWithSecret",
    "SessionInfo",
    "Tenant",
    "TenantCreate",
    "TokenResponse",
    "User",
    "UserCreate",
    "UserCreated",
    "UserStatus",
]


class TenantCreate(BaseModel):
    slug: str = Field(pattern=SLUG, description="lowercase letters, digits and dashes")
    name: Name = Field(min_length=1, max_length=200)


class Tenant(BaseModel):
    tenant_id: uuid.UUID
    slug: str
    name: str
    status: str


class ProjectCreate(BaseModel):
    name: Name = Field(min_length=1, max_length=100)


class Project(BaseModel):
    project_id: uuid.UUID
    tenant_id: uuid.UUID
    name: str
    archived: bool


class UserCreate(BaseModel):
    email: EmailStr
    password: str = Field(min_length=12, max_length=256)
    display_name: Name = Field("", max_length=200)
    role: Role | None = Field(
        Role.project_member,
        description="tenant-wide without `project_id`; project_admin needs a project (422 `project_required`)",
    )
    project_id: uuid.UUID | None = Field(
        None, description="a project of this tenant: the role (a project role) is granted there, project-scoped"
    )
    email_verified: bool = Field(False, description="the admin vouches for the address (used by federation)")


class PlatformUserCreate(BaseModel):
    email: EmailStr
    password: str = Field(min_length=12, max_length=256)
    display_name: Name = Field("", max_length=200)


class MemberAdd(BaseModel):
    user_id: uuid.UUID
    role: Role


class PlatformAdminAdd(BaseModel):
    user_id: uuid.UUID


class ServiceAccountCreate(BaseModel):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    scopes: list[str] = Field(min_length=1, max_length=20)


class IdpCreate(BaseModel):
    name: Name = Field(min_length=1, max_length=200)
    issuer: str = Field(pattern=r"^https?://", max_length=500)
    client_id: str = Field(min_length=1, max_length=300)
    client_secret: str | None = Field(None, max_length=500)
    domains: list[Annotated[str, Field(pattern=DOMAIN, max_length=253)]] = Field(min_length=1, max_length=50)
    default_role: Role | None = Role.project_member
    enforce_sso: bool = False
    domains_verified: bool = Field(
        False,
        description="a platform admin attests that the tenant owns the domains (else 403); without it each "
        "domain is a claim until proven by its DNS TXT challenge (POST .../domains/{domain}/verify)",
    )


class Idp(BaseModel):
    idp_id: uuid.UUID
    tenant_id: uuid.UUID
    name: str
    issuer: str
    domains: list[str] = Field(description="every domain claimed (proven or not); see domain_claims")
    default_role: Role | None
    enforce_sso: bool
    enabled: bool
    domain_claims: list[DomainClaim] = []


class Discovery(BaseModel):
    email: str
    account_type: Literal["personal", "work"]
    login: Literal["password", "sso"]
    tenant: dict[str, Any] | None
    identity_provider: dict[str, Any] | None
    tenant_hint: dict[str, Any] | None


class OAuthClientCreate(BaseModel):
    name: Name = Field(min_length=1, max_length=200)
    redirect_uris: list[Annotated[str, Field(pattern=r"^https?://", max_length=500)]] = Field(min_length=1)
    confidential: bool = True
    tenant_id: uuid.UUID | None = Field(None, description="serve only this tenant's users (else any user)")
