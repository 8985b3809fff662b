"""`gpuaas.identity.v1`: tenants, projects, users, memberships, service accounts.

Event-carried state transfer: every event holds the entity's full current state, so any
service can rebuild its `gpuaas.kit.iam` projection from the topic alone.
"""

# Each event class narrows the envelope's `type: str` to its own Literal (the discriminator of its topic's
# union): pydantic's way, which the checker calls an incompatible override of a mutable field.
# pyright: reportIncompatibleVariableOverride=false
from __future__ import annotations

import uuid
from typing import Literal

from pydantic import Field

from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.envelope import Event, Payload


class TenantState(Payload):
    aggregate_field = "tenant_id"

    tenant_id: uuid.UUID
    slug: str
    name: str
    status: Literal["active", "suspended"] = "active"


class ProjectState(Payload):
    aggregate_field = "project_id"

    project_id: uuid.UUID
    tenant_id: uuid.UUID
    name: str
    archived: bool = False


class UserState(Payload):
    aggregate_field = "user_id"

    user_id: uuid.UUID
    email: str
    display_name: str = ""
    tenant_id: uuid.UUID | None = Field(default=None, description="home tenant; None for personal accounts")
    status: Literal["active", "disabled"] = "active"


class MembershipState(Payload):
    """A role held by a user at platform, tenant or project scope. `revoked` ends it."""

    aggregate_field = "membership_id"

    membership_id: uuid.UUID
    user_id: uuid.UUID
    scope: MembershipScope
    role: Role
    tenant_id: uuid.UUID | None = None
    project_id: uuid.UUID | None = None
    revoked: bool = False


class ServiceAccountState(Payload):
    aggregate_field = "service_account_id"

    service_account_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    name: str
    scopes: list[str] = Field(default_factory=list)
    disabled: bool = False


class IdentityProviderState(Payload):
    """A tenant's enterprise OIDC identity provider and the email domains the tenant owns through it."""

    aggregate_field = "idp_id"

    idp_id: uuid.UUID
    tenant_id: uuid.UUID
    name: str
    issuer: str
    domains: list[str] = Field(default_factory=list)
    default_role: Role | None = None
    enforce_sso: bool = False
    enabled: bool = True


class FederatedIdentityState(Payload):
    """A user's link to a subject at a tenant's identity provider (brokered identity linking)."""

    aggregate_field = "user_id"

    user_id: uuid.UUID
    tenant_id: uuid.UUID
    idp_id: uuid.UUID
    subject: str
    email: str
    link_method: Literal["verified_email", "jit"]


class SessionState(Payload):
    """A login session (refresh-token family). Revocation ends every token of the family."""

    aggregate_field = "session_id"

    session_id: uuid.UUID
    user_id: uuid.UUID
    revoked: bool = False
    revoked_reason: str | None = None


class TenantCreated(Event):
    type: Literal["tenant.created"] = "tenant.created"
    data: TenantState


class TenantUpdated(Event):
    type: Literal["tenant.updated"] = "tenant.updated"
    data: TenantState


class ProjectCreated(Event):
    type: Literal["project.created"] = "project.created"
    data: ProjectState


class ProjectUpdated(Event):
    type: Literal["project.updated"] = "project.updated"
    data: ProjectState


class UserCreated(Event):
    type: Literal["user.created"] = "user.created"
    data: UserState


class UserUpdated(Event):
    type: Literal["user.updated"] = "user.updated"
    data: UserState


class MembershipGranted(Event):
    type: Literal["membership.granted"] = "membership.granted"
    data: MembershipState


class MembershipChanged(Event):
    type: Literal["membership.changed"] = "membership.changed"
    data: MembershipState


class MembershipRevoked(Event):
    type: Literal["membership.revoked"] = "membership.revoked"
    data: MembershipState


class ServiceAccountCreated(Event):
    type: Literal["service_account.created"] = "service_account.created"
    data: ServiceAccountState


class ServiceAccountUpdated(Event):
    type: Literal["service_account.updated"] = "service_account.updated"
    data: ServiceAccountState


class ServiceAccountDisabled(Event):
    type: Literal["service_account.disabled"] = "service_account.disabled"
    data: ServiceAccountState


class ServiceAccountSecretRotated(Event):
    """The account's secret was replaced: every token issued before this event is revoked in every service
    (`gpuaas.kit.revocation`). The state is unchanged otherwise (the IAM projection ignores it)."""

    type: Literal["service_account.secret_rotated"] = "service_account.secret_rotated"
    data: ServiceAccountState


class IdentityProviderCreated(Event):
    type: Literal["identity_provider.created"] = "identity_provider.created"
    data: IdentityProviderState


class IdentityProviderUpdated(Event):
    type: Literal["identity_provider.updated"] = "identity_provider.updated"
    data: IdentityProviderState


class FederatedIdentityLinked(Event):
    type: Literal["federated_identity.linked"] = "federated_identity.linked"
    data: FederatedIdentityState


class SessionRevoked(Event):
    type: Literal["session.revoked"] = "session.revoked"
    data: SessionState


EVENTS: tuple[type[Event], ...] = (
    TenantCreated,
    TenantUpdated,
    ProjectCreated,
    ProjectUpdated,
    UserCreated,
    UserUpdated,
    MembershipGranted,
    MembershipChanged,
    MembershipRevoked,
    ServiceAccountCreated,
    ServiceAccountUpdated,
    ServiceAccountDisabled,
    ServiceAccountSecretRotated,
    IdentityProviderCreated,
    IdentityProviderUpdated,
    FederatedIdentityLinked,
    SessionRevoked,
)
