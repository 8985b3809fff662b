"""App-runtime's tables (schema `app_runtime`): its own aggregates plus the projections it keeps of
allocations and catalog (fed by their events; never read from their services)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

from gpuaas.kit.db import NAMING_CONVENTION

metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _ts(name: str, nullable: bool = False) -> Column:
    return Column(name, DateTime(timezone=True), nullable=nullable, server_default=None if nullable else func.now())


def _uuid(name: str, *args: Any, nullable: bool = False, **kw: Any) -> Column:
    return Column(name, UUID(as_uuid=True), *args, nullable=nullable, **kw)


# --- projections (last writer wins by the entity's own change counter) ---

allocations = Table(
    "allocations",
    metadata,
    _uuid("allocation_id", primary_key=True),
    _uuid("tenant_id"),
    _uuid("project_id"),
    Column("status", Text, nullable=False),
    Column("shape", Text, nullable=False),
    Column("gpu_model", Text, nullable=False),
    Column("gpu_count", Integer, nullable=False),
    _uuid("host_id", nullable=True),
    Column("version", Integer, nullable=False),
    Column("state", JSONB, nullable=False),
    _ts("updated_at"),
)

manifests = Table(
    "manifests",
    metadata,
    _uuid("manifest_id", primary_key=True),
    Column("slug", Text, nullable=False),
    Column("app_version", Text, nullable=False),
    Column("active", Boolean, nullable=False),
    Column("deprecated", Boolean, nullable=False),
    Column("artifact_ref", Text, nullable=False),
    Column("revision", Integer, nullable=False),
    Column("state", JSONB, nullable=False),
    _ts("updated_at"),
    Index("ix_manifests_slug_version", "slug", "app_version"),
)

entitlements = Table(
    "entitlements",
    metadata,
    _uuid("entitlement_id", primary_key=True),
    _uuid("tenant_id"),
    Column("app_slug", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("version", Integer, nullable=False),
    _ts("updated_at"),
    Index("ix_entitlements_tenant_slug", "tenant_id", "app_slug"),
)

# --- own aggregates ---

controller_bindings = Table(
    "controller_bindings",
    metadata,
    _uuid("binding_id", primary_key=True),
    _uuid("tenant_id"),
    _uuid("project_id"),
    Column("app_slug", Text, nullable=False),
    _uuid("service_account_id"),
    _ts("created_at"),
    UniqueConstraint("project_id", "app_slug", name="uq_controller_bindings_project_app"),
)

instances = Table(
    "instances",
    metadata,
    _uuid("instance_id", primary_key=True),
    _uuid("tenant_id"),
    _uuid("project_id"),
    Column("name", Text, nullable=False),
    Column("app_slug", Text, nullable=False),
    Column("app_version", Text, nullable=False),
    _uuid("manifest_id"),
    Column("artifact_digest", Text, nullable=False),
    Column("status", Text, nullable=False),
    _ts("status_changed_at"),
    Column("placement_intent", JSONB, nullable=False),
    Column("config", JSONB, nullable=False),
    Column("runtime_detail", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("health", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("failure_reason", Text),
    Column("decommission", JSONB),
    _uuid("desired_manifest_id", nullable=True),
    Column("desired_app_version", Text),
    _uuid("previous_manifest_id", nullable=True),
    Column("version", Integer, nullable=False),
    _ts("created_at"),
    Index("ix_instances_project", "project_id"),
    Index("ix_instances_app", "project_id", "app_slug"),
)

members = Table(
    "members",
    metadata,
    _uuid("member_id", primary_key=True),
    _uuid("instance_id", ForeignKey("instances.instance_id")),
    _uuid("tenant_id"),
    _uuid("project_id"),
    Column("component_key", Text, nullable=False),
    _uuid("allocation_id"),
    Column("status", Text, nullable=False),
    _ts("status_changed_at"),
    _uuid("last_operation_id", nullable=True),
    Column("detail", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("tombstoned", Boolean, nullable=False, server_default="false"),
    Column("tombstone_reason", Text),
    Column("version", Integer, nullable=False),
    _ts("created_at"),
    Index("ix_members_instance", "instance_id"),
    Index("ix_members_allocation", "allocation_id"),
)

operations = Table(
    "operations",
    metadata,
    _uuid("operation_id", primary_key=True),
    _uuid("instance_id", ForeignKey("instances.instance_id")),
    _uuid("tenant_id"),
    _uuid("project_id"),
    Column("app_slug", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("status", Text, nullable=False),
    _uuid("member_id", nullable=True),
    Column("component_key", Text),
    _uuid("allocation_id", nullable=True),
    Column("params", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("claimed_by", Text),
    _uuid("lease_token", nullable=True),
    Column("lease_expires_at", DateTime(timezone=True)),
    Column("attempt", Integer, nullable=False, server_default="0"),
    Column("progress_message", Text, nullable=False, server_default=""),
    Column("progress_percent", Integer),
    Column("error", Text),
    Column("forced", Boolean, nullable=False, server_default="false"),
    Column("result", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    _uuid("result_member_id", nullable=True),
    Column("lease_s", Integer),  # the lease length the current claim asked for
    Column("deferred_until", DateTime(timezone=True)),  # deferred by its controller: not offered before then
    Column("version", Integer, nullable=False),
    _ts("created_at"),
    _ts("updated_at"),
    Index("ix_operations_claimable", "project_id", "app_slug", "status"),
    Index("ix_operations_instance", "instance_id"),
)

instance_events = Table(
    "instance_events",
    metadata,
    Column("seq", BigInteger, Identity(), primary_key=True),
    _uuid("instance_id"),
    Column("kind", Text, nullable=False),
    Column("message", Text, nullable=False, server_default=""),
    Column("data", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("actor", Text),
    _ts("occurred_at"),
    Index("ix_instance_events_instance_seq", "instance_id", "seq"),
)

credentials = Table(
    "credentials",
    metadata,
    # also the access grant id: one grant per credential
    _uuid("credential_id", primary_key=True),
    _uuid("instance_id", ForeignKey("instances.instance_id")),
    _uuid("tenant_id"),
    _uuid("project_id"),
    Column("public_key", Text, nullable=False),
    Column("fingerprint", Text, nullable=False),
    Column("custody", Text, nullable=False),  # "schema" (envelope-encrypted here) | "vault"
    Column("ciphertext", LargeBinary),
    Column("nonce", LargeBinary),
    Column("wrapped_dek", LargeBinary),
    Column("dek_nonce", LargeBinary),
    Column("kek_id", Text),
    Column("vault_path", Text),
    Column("status", Text, nullable=False),  # active | revoked
    _uuid("rotated_from", nullable=True),
    Column("allocation_ids", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("version", Integer, nullable=False),
    _ts("created_at"),
    _ts("revoked_at", nullable=True),
    Index("ix_credentials_instance", "instance_id"),
)

release_requests = Table(
    "release_requests",
    metadata,
    _uuid("allocation_id", primary_key=True),
    _uuid("tenant_id"),
    _uuid("project_id"),
    _ts("requested_at"),
    _ts("cleared_at", nullable=True),
    Column("forced", Boolean, nullable=False, server_default="false"),
)

# A controller's own state per instance (the SDK's `StoredState`): opaque to the platform, versioned so that two
# replicas of a controller cannot overwrite each other (compare-and-set on `version`).
controller_states = Table(
    "controller_states",
    metadata,
    _uuid("instance_id", ForeignKey("instances.instance_id"), primary_key=True),
    Column("state", JSONB, nullable=False),
    Column("version", Integer, nullable=False),
    Column("updated_by", Text),
    _ts("updated_at"),
)
