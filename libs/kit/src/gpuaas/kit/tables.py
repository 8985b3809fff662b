"""Tables the kit owns inside every service's schema: outbox, inbox, dead letters, idempotency keys,
and the IAM projection. Created by the kit's own Alembic branch (`kit`), see migrations/versions.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

from gpuaas.kit.db import NAMING_CONVENTION

kit_metadata = MetaData(naming_convention=NAMING_CONVENTION)

outbox = Table(
    "outbox",
    kit_metadata,
    # Insertion order; with one active relay and aggregates locked by their use cases, also the
    # per-aggregate commit order.
    Column("seq", BigInteger, Identity(always=True), primary_key=True),
    Column("event_id", UUID(as_uuid=True), nullable=False, unique=True),
    Column("topic", Text, nullable=False),
    Column("event_type", Text, nullable=False),
    Column("aggregate_id", Text, nullable=False),
    Column("payload", LargeBinary, nullable=False),
    Column("headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("sent_at", DateTime(timezone=True)),
    Index("ix_outbox_unsent", "seq", postgresql_where=text("sent_at IS NULL")),
    Index("ix_outbox_created_at", "created_at"),
)

inbox = Table(
    "inbox",
    kit_metadata,
    Column("consumer", Text, nullable=False),
    Column("event_id", UUID(as_uuid=True), nullable=False),
    Column("event_type", Text, nullable=False),
    Column("topic", Text, nullable=False),
    Column("partition", Integer, nullable=False),
    Column("offset", BigInteger, nullable=False),
    Column("applied_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("consumer", "event_id"),
)

dead_letters = Table(
    "dead_letters",
    kit_metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("consumer", Text, nullable=False),
    Column("event_id", UUID(as_uuid=True)),
    Column("event_type", Text),
    Column("topic", Text, nullable=False),
    Column("partition", Integer, nullable=False),
    Column("offset", BigInteger, nullable=False),
    Column("key", LargeBinary),
    Column("payload", LargeBinary, nullable=False),
    Column("error", Text, nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("status", Text, nullable=False, server_default="parked"),  # parked | resolved
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("ix_dead_letters_status", "status"),
)

# Numbers the events whose topics need a per-record order (kit.outbox stamps envelope `sequence`).
event_sequence = Sequence("event_sequence", metadata=kit_metadata)

idempotency_keys = Table(
    "idempotency_keys",
    kit_metadata,
    Column("principal", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("method", Text, nullable=False),
    Column("path", Text, nullable=False),
    Column("request_hash", Text, nullable=False),
    Column("status_code", Integer),  # NULL while the first request is in flight
    Column("response_body", LargeBinary),
    Column("response_headers", JSONB),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # Set by the request's own writing transaction (kit.idempotency.mark_committed): effect committed.
    Column("committed_at", DateTime(timezone=True)),
    PrimaryKeyConstraint("principal", "key"),
)

# --- IAM projection, fed by gpuaas.identity.v1 (see kit.iam) ---

iam_tenants = Table(
    "iam_tenants",
    kit_metadata,
    Column("tenant_id", UUID(as_uuid=True), primary_key=True),
    Column("slug", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("version", BigInteger),  # envelope `sequence` of the state held (kit.iam)
)

iam_projects = Table(
    "iam_projects",
    kit_metadata,
    Column("project_id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False, index=True),
    Column("name", Text, nullable=False),
    Column("archived", Boolean, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("version", BigInteger),  # envelope `sequence` of the state held (kit.iam)
)

iam_users = Table(
    "iam_users",
    kit_metadata,
    Column("user_id", UUID(as_uuid=True), primary_key=True),
    Column("email", Text, nullable=False),
    Column("tenant_id", UUID(as_uuid=True)),
    Column("status", Text, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("version", BigInteger),  # envelope `sequence` of the state held (kit.iam)
)

iam_memberships = Table(
    "iam_memberships",
    kit_metadata,
    Column("membership_id", UUID(as_uuid=True), primary_key=True),
    Column("user_id", UUID(as_uuid=True), nullable=False, index=True),
    Column("scope", Text, nullable=False),
    Column("role", Text, nullable=False),
    Column("tenant_id", UUID(as_uuid=True)),
    Column("project_id", UUID(as_uuid=True)),
    Column("revoked", Boolean, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("version", BigInteger),  # envelope `sequence` of the state held (kit.iam)
)

iam_service_accounts = Table(
    "iam_service_accounts",
    kit_metadata,
    Column("service_account_id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("project_id", UUID(as_uuid=True), nullable=False),
    Column("name", Text, nullable=False),
    Column("scopes", ARRAY(Text), nullable=False),
    Column("disabled", Boolean, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("version", BigInteger),  # envelope `sequence` of the state held (kit.iam)
)

# --- revocations, fed by gpuaas.identity.v1 (see kit.revocation) ---

revocations = Table(
    "revocations",
    kit_metadata,
    Column("kind", Text, nullable=False),  # session (key: sid) | subject (key: user/SA id) | access (wake only)
    Column("key", UUID(as_uuid=True), nullable=False),
    Column("not_before", DateTime(timezone=True)),  # subject: tokens issued before are refused
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.clock_timestamp()),
    PrimaryKeyConstraint("kind", "key"),
    Index("ix_revocations_updated_at", "updated_at"),
)
