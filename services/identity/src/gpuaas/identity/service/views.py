"""What identity's use cases answer where no contract state fits: small typed view models.

They are the API's response models too (api/schemas.py re-exports them), so each shape is defined
once; tenants, projects and identity providers are answered as their contract states
(gpuaas.contracts.events.identity) and shaped by api/schemas.py.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from gpuaas.contracts.enums import Role


class TokenResponse(BaseModel):
    access_token: str
    token_type: str
    expires_in: int
    refresh_token: str | None = None
    session_id: uuid.UUID | None = None
    id_token: str | None = None
    scope: str | None = None
    link_method: str | None = None


class UserCreated(BaseModel):
    user_id: uuid.UUID
    email: str
    tenant_id: uuid.UUID | None
    membership_id: uuid.UUID | None


class User(BaseModel):
    user_id: uuid.UUID
    email: str
    display_name: str
    tenant_id: uuid.UUID | None
    status: str
    email_verified: bool
    last_login_at: datetime | None = None


class UserStatus(BaseModel):
    user_id: uuid.UUID
    email: str
    tenant_id: uuid.UUID | None
    status: str


class Membership(BaseModel):
    membership_id: uuid.UUID
    user_id: uuid.UUID
    scope: str
    role: Role
    tenant_id: uuid.UUID | None
    project_id: uuid.UUID | None
    email: str | None = None
    display_name: str | None = None  # the project member list shows it (the console's member picker)


class Granted(BaseModel):
    membership_id: uuid.UUID
    user_id: uuid.UUID
    role: Role
    tenant_id: uuid.UUID | None = None
    project_id: uuid.UUID | None = None


class Me(BaseModel):
    user_id: uuid.UUID
    email: str
    display_name: str
    tenant_id: uuid.UUID | None
    status: str
    email_verified: bool
    memberships: list[Membership]


class SessionInfo(BaseModel):
    session_id: uuid.UUID
    method: str
    idp_id: uuid.UUID | None
    user_agent: str | None
    client_ip: str | None
    created_at: datetime
    last_used_at: datetime
    expires_at: datetime
    revoked: bool
    revoked_reason: str | None
    current: bool


class ServiceAccount(BaseModel):
    service_account_id: uuid.UUID
    client_id: str
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    name: str
    scopes: list[str]
    disabled: bool
    created_at: datetime
    secret_rotated_at: datetime


class ServiceAccountWithSecret(ServiceAccount):
    client_secret: str = Field(description="shown once; store it now")


class OAuthClient(BaseModel):
    client_id: str
    client_secret: str | None
    name: str
    redirect_uris: list[str]
    tenant_id: uuid.UUID | None = None


class KeyRotation(BaseModel):
    kid: str
    retired: list[str]


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


class DiscoveredTenant(BaseModel):
    tenant_id: uuid.UUID
    slug: str
    name: str


class DiscoveredIdp(BaseModel):
    idp_id: uuid.UUID
    name: str
    enforce_sso: bool
    sso_start_url: str


class TenantHint(BaseModel):
    slug: str
    matches: bool


class AccountDiscovery(BaseModel):
    """Personal vs work account (the API answers it as `Discovery`)."""

    email: str
    account_type: Literal["personal", "work"]
    login: Literal["password", "sso"]
    tenant: DiscoveredTenant | None
    identity_provider: DiscoveredIdp | None
    tenant_hint: TenantHint | None


class DomainClaim(BaseModel):
    """An email domain an IdP claims; `verified` once proven. Publish `challenge_value` as a TXT record
    at `challenge_name`, then ask identity to verify."""

    domain: str
    verified: bool
    verified_at: datetime | None
    challenge_name: str
    challenge_value: str


class IdentityProvider(BaseModel):
    """A tenant's IdP (the contract state's fields) with its domain claims."""

    idp_id: uuid.UUID
    tenant_id: uuid.UUID
    name: str
    issuer: str
    domains: list[str]
    default_role: Role | None
    enforce_sso: bool
    enabled: bool
    domain_claims: list[DomainClaim]
