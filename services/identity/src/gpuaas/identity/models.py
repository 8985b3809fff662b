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
    MetaData,
    Table,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

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
