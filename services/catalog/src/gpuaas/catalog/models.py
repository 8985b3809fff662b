"""Catalog's tables (schema `catalog`): artifacts and their promotion history, app manifests,
entitlements, and the projection of which artifact digests app-runtime instances use."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
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

artifacts = Table(
    "artifacts",
    metadata,
    Column("artifact_id", UUID(as_uuid=True), primary_key=True),
    Column("kind", Text, nullable=False),  # oci | blob
    Column("ref", Text, nullable=False),  # registry/repo@sha256:... (never a tag)
    Column("registry", Text, nullable=False),
    Column("repository", Text, nullable=False),
    Column("digest", Text, nullable=False),
    Column("media_type", Text),
    Column("artifact_type", Text),  # OCI `artifactType` / config media type of non-container artifacts
    Column("size_bytes", BigInteger),
    Column("state", Text, nullable=False),
    Column("canary_tenants", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("checks", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("signature_verified", Boolean, nullable=False, server_default=text("false")),
    Column("signature_detail", Text),
    Column("version", Integer, nullable=False, server_default="1"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    UniqueConstraint("ref", name="uq_artifacts_ref"),
)
Index("ix_artifacts_digest", artifacts.c.digest)

# One row per lifecycle move (Prefect-style state history); the current state is on `artifacts`.
artifact_transitions = Table(
    "artifact_transitions",
    metadata,
    Column("transition_id", UUID(as_uuid=True), primary_key=True),
    Column("artifact_id", UUID(as_uuid=True), ForeignKey("artifacts.artifact_id"), nullable=False, index=True),
    Column("from_state", Text),  # NULL for the registration (→ draft)
    Column("to_state", Text, nullable=False),
    Column("actor_kind", Text, nullable=False),
    Column("actor_id", Text, nullable=False),
    Column("reason", Text, nullable=False, server_default=""),
    Column("detail", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("occurred_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

manifests = Table(
    "manifests",
    metadata,
    Column("manifest_id", UUID(as_uuid=True), primary_key=True),
    Column("slug", Text, nullable=False),
    Column("version", Text, nullable=False),  # the app's own version
    Column("runtime_version", Text),  # the daemon it installs, e.g. "Slurm 22.05"
    Column("display_name", Text, nullable=False),
    Column("description", Text, nullable=False, server_default=""),
    Column("artifact_kind", Text, nullable=False),
    Column("artifact_ref", Text, nullable=False),
    Column("artifact_id", UUID(as_uuid=True), ForeignKey("artifacts.artifact_id"), nullable=False, index=True),
    Column("compatibility", JSONB, nullable=False),
    Column("runtime_profile", JSONB),
    Column("inputs", JSONB, nullable=False),
    Column("roles", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("active", Boolean, nullable=False, server_default=text("false")),
    Column("deprecated", Boolean, nullable=False, server_default=text("false")),
    Column("revision", Integer, nullable=False, server_default="1"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    UniqueConstraint("slug", "version", name="uq_manifests_slug_version"),
)

entitlements = Table(
    "entitlements",
    metadata,
    Column("entitlement_id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("app_slug", Text, nullable=False),
    Column("status", Text, nullable=False),  # granted | revoked
    Column("granted_at", DateTime(timezone=True), nullable=False),
    Column("revoked_at", DateTime(timezone=True)),
    Column("version", Integer, nullable=False, server_default="1"),
    UniqueConstraint("tenant_id", "app_slug", name="uq_entitlements_tenant_app"),
)

# Projection of app-runtime's instances: which digest each instance runs (the retire gate).
instance_digests = Table(
    "instance_digests",
    metadata,
    Column("instance_id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("manifest_id", UUID(as_uuid=True)),
    Column("artifact_digest", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("source_version", Integer, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)
Index("ix_instance_digests_artifact_digest", instance_digests.c.artifact_digest)
