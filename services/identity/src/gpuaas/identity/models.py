"""Identity's tables (schema `identity`)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

from gpuaas.kit.db import NAMING_CONVENTION

metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _ts(name: str, nullable: bool = False) -> Column:
    return Column(name, DateTime(timezone=True), nullable=nullable, server_default=None if nullable else func.now())


signing_keys = Table(
    "signing_keys",
    metadata,
    Column("kid", Text, primary_key=True),
    Column("private_jwk", JSONB, nullable=False),
    Column("public_jwk", JSONB, nullable=False),
    _ts("created_at"),
    # Retired keys stop signing but stay in the JWKS until every token they signed has expired.
    _ts("retired_at", nullable=True),
)

tenants = Table(
    "tenants",
    metadata,
    Column("tenant_id", UUID(as_uuid=True), primary_key=True),
    Column("slug", Text, nullable=False, unique=True),
    Column("name", Text, nullable=False),
    Column("status", Text, nullable=False),
    _ts("created_at"),
)

projects = Table(
    "projects",
    metadata,
    Column("project_id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), ForeignKey("tenants.tenant_id"), nullable=False),
    Column("name", Text, nullable=False),
    Column("archived", Boolean, nullable=False, server_default="false"),
    _ts("created_at"),
    UniqueConstraint("tenant_id", "name", name="uq_projects_tenant_name"),
)

users = Table(
    "users",
    metadata,
    Column("user_id", UUID(as_uuid=True), primary_key=True),
    Column("email", Text, nullable=False),
    Column("display_name", Text, nullable=False, server_default=""),
    Column("tenant_id", UUID(as_uuid=True), ForeignKey("tenants.tenant_id")),
    Column("password_hash", Text),
    Column("status", Text, nullable=False),
    _ts("created_at"),
    # Asserted by an admin at creation, or by the enterprise IdP (`email_verified` claim) at federation.
    Column("email_verified", Boolean, nullable=False, server_default="false"),
    _ts("last_login_at", nullable=True),
)
Index("uq_users_email_lower", func.lower(users.c.email), unique=True)

memberships = Table(
    "memberships",
    metadata,
    Column("membership_id", UUID(as_uuid=True), primary_key=True),
    Column("user_id", UUID(as_uuid=True), ForeignKey("users.user_id"), nullable=False, index=True),
    Column("scope", Text, nullable=False),
    Column("role", Text, nullable=False),
    Column("tenant_id", UUID(as_uuid=True), ForeignKey("tenants.tenant_id")),
    Column("project_id", UUID(as_uuid=True), ForeignKey("projects.project_id")),
    Column("revoked", Boolean, nullable=False, server_default="false"),
    _ts("created_at"),
    _ts("revoked_at", nullable=True),
)

audit_records = Table(
    "audit_records",
    metadata,
    Column("seq", BigInteger, Identity(always=True), primary_key=True),
    # The audit event's id: unique, so the store can never hold a record twice.
    Column("event_id", UUID(as_uuid=True), nullable=False, unique=True),
    Column("occurred_at", DateTime(timezone=True), nullable=False),
    # clock_timestamp(): when this row was written, not when its batch transaction began.
    Column("stored_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    Column("service", Text, nullable=False),
    Column("actor_kind", Text, nullable=False),
    Column("actor_id", Text, nullable=False),
    Column("tenant_id", UUID(as_uuid=True), index=True),
    Column("project_id", UUID(as_uuid=True)),
    Column("action", Text, nullable=False),
    Column("resource_type", Text, nullable=False),
    Column("resource_id", Text, nullable=False),
    Column("outcome", Text, nullable=False),
    Column("before", JSONB),
    Column("after", JSONB),
    Column("reason", Text),
    Column("correlation_id", Text),
    Index("ix_audit_records_occurred_at", "occurred_at"),
)


# Brute-force protection: failures per key (`acct:<email>` or `ip:<address>`) in a sliding window.
login_throttle = Table(
    "login_throttle",
    metadata,
    Column("key", Text, primary_key=True),
    Column("failures", Integer, nullable=False, server_default="0"),
    Column("window_started_at", DateTime(timezone=True), nullable=False),
    Column("locked_until", DateTime(timezone=True)),
)

# A login session = one refresh-token family. Revoking it ends every refresh token of the family.
sessions = Table(
    "sessions",
    metadata,
    Column("session_id", UUID(as_uuid=True), primary_key=True),
    Column("user_id", UUID(as_uuid=True), ForeignKey("users.user_id"), nullable=False, index=True),
    Column("method", Text, nullable=False),  # password | sso
    Column("idp_id", UUID(as_uuid=True)),
    Column("user_agent", Text),
    Column("client_ip", Text),
    _ts("created_at"),
    _ts("last_used_at"),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    _ts("revoked_at", nullable=True),
    Column("revoked_reason", Text),
)

refresh_tokens = Table(
    "refresh_tokens",
    metadata,
    Column("token_hash", Text, primary_key=True),  # sha256 of the opaque token; the token is never stored
    Column("session_id", UUID(as_uuid=True), ForeignKey("sessions.session_id"), nullable=False, index=True),
    _ts("created_at"),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    # Set when the token is exchanged; presenting it again is reuse and revokes the whole session.
    _ts("used_at", nullable=True),
)

service_accounts = Table(
    "service_accounts",
    metadata,
    Column("service_account_id", UUID(as_uuid=True), primary_key=True),  # also the OAuth client_id
    Column("tenant_id", UUID(as_uuid=True), ForeignKey("tenants.tenant_id"), nullable=False),
    Column("project_id", UUID(as_uuid=True), ForeignKey("projects.project_id"), nullable=False, index=True),
    Column("name", Text, nullable=False),
    Column("scopes", ARRAY(Text), nullable=False),
    Column("secret_hash", Text, nullable=False),  # sha256 of a 256-bit random secret
    Column("disabled", Boolean, nullable=False, server_default="false"),
    _ts("created_at"),
    _ts("secret_rotated_at"),
    UniqueConstraint("project_id", "name", name="uq_service_accounts_project_name"),
)

identity_providers = Table(
    "identity_providers",
    metadata,
    Column("idp_id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), ForeignKey("tenants.tenant_id"), nullable=False, index=True),
    Column("name", Text, nullable=False),
    Column("issuer", Text, nullable=False),
    Column("client_id", Text, nullable=False),
    Column("client_secret", Text),
    Column("default_role", Text),
    Column("enforce_sso", Boolean, nullable=False, server_default="false"),
    Column("enabled", Boolean, nullable=False, server_default="true"),
    _ts("created_at"),
)

# A domain is owned by exactly one identity provider (so by one tenant): the primary key enforces it.
# A tenant's claim of an email domain for its IdP. Claims are many until one is proven (DNS TXT
# challenge, or an operator's attestation): a proven domain belongs to one IdP only (the partial
# unique index), and only proven domains serve discovery, linking and enforced SSO.
idp_domains = Table(
    "idp_domains",
    metadata,
    Column("domain", Text, primary_key=True),
    Column("idp_id", UUID(as_uuid=True), ForeignKey("identity_providers.idp_id"), primary_key=True, index=True),
    Column("challenge", Text, nullable=False),
    Column("verified_at", DateTime(timezone=True)),
    Column("verified_by", Text),
    Index("ux_idp_domains_verified", "domain", unique=True, postgresql_where=text("verified_at IS NOT NULL")),
)

federated_identities = Table(
    "federated_identities",
    metadata,
    Column("idp_id", UUID(as_uuid=True), ForeignKey("identity_providers.idp_id"), primary_key=True),
    Column("subject", Text, primary_key=True),
    Column("user_id", UUID(as_uuid=True), ForeignKey("users.user_id"), nullable=False, index=True),
    Column("email", Text, nullable=False),
    Column("link_method", Text, nullable=False),
    _ts("linked_at"),
)

# Pending SSO logins (authorization code + PKCE): single use, short-lived.
sso_states = Table(
    "sso_states",
    metadata,
    Column("state", Text, primary_key=True),
    Column("idp_id", UUID(as_uuid=True), ForeignKey("identity_providers.idp_id"), nullable=False),
    Column("code_verifier", Text, nullable=False),
    Column("nonce", Text, nullable=False),
    Column("redirect_uri", Text, nullable=False),
    _ts("created_at"),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    _ts("used_at", nullable=True),
    # Where the browser goes back after the callback (the console, or the CLI's loopback listener),
    # validated at start; None: the callback answers the token pair as JSON.
    Column("return_to", Text),
    # The S256 challenge of the client that started the login (RFC 7636, required with return_to);
    # copied to the login code, whose exchange must present the verifier. Not the IdP-side PKCE above.
    Column("client_code_challenge", Text),
)

# The outcome of a completed SSO login handed to `return_to`: a short-lived, single-use code that
# `POST /auth/token` (grant_type=sso_login_code) exchanges for a session; never the tokens in a URL.
sso_login_codes = Table(
    "sso_login_codes",
    metadata,
    Column("code_hash", Text, primary_key=True),  # sha256 of the code; the code itself is never stored
    Column("user_id", UUID(as_uuid=True), ForeignKey("users.user_id"), nullable=False),
    Column("idp_id", UUID(as_uuid=True), ForeignKey("identity_providers.idp_id"), nullable=False),
    Column("link_method", Text, nullable=False),
    Column("return_to", Text, nullable=False),
    # The starting client's S256 challenge: the exchange presents its verifier (None only for codes
    # issued before identity_0005, which expire within a minute of the upgrade).
    Column("code_challenge", Text),
    _ts("created_at"),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    _ts("used_at", nullable=True),
)

# Relying parties of this identity service acting as an OIDC provider (authorization code + PKCE).
oauth_clients = Table(
    "oauth_clients",
    metadata,
    Column("client_id", Text, primary_key=True),
    Column("name", Text, nullable=False),
    Column("secret_hash", Text),  # None: a public client (PKCE only)
    Column("redirect_uris", ARRAY(Text), nullable=False),
    # A client of one tenant serves only that tenant's users; None: a platform-wide client.
    Column("tenant_id", UUID(as_uuid=True), ForeignKey("tenants.tenant_id")),
    _ts("created_at"),
)

authorization_codes = Table(
    "authorization_codes",
    metadata,
    Column("code_hash", Text, primary_key=True),
    Column("client_id", Text, ForeignKey("oauth_clients.client_id"), nullable=False),
    Column("user_id", UUID(as_uuid=True), ForeignKey("users.user_id"), nullable=False),
    Column("redirect_uri", Text, nullable=False),
    Column("code_challenge", Text, nullable=False),
    Column("nonce", Text),
    Column("scope", Text, nullable=False),
    _ts("created_at"),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    _ts("used_at", nullable=True),
)
