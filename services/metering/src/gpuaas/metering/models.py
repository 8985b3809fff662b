"""Metering's tables (schema `metering`): meters, usage records, app usage records, and the projections of
hosts (heartbeat rule) and app instances (attribution of app usage) fed by allocations / app-runtime events."""

from __future__ import annotations

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Index,
    Integer,
    MetaData,
    Numeric,
    Table,
    Text,
    func,
)
from sqlalchemy.dialects.postgresql import UUID

from gpuaas.kit.db import NAMING_CONVENTION

metadata = MetaData(naming_convention=NAMING_CONVENTION)

# One meter per allocation: the open usage interval. GPU time before `billed_until` is in usage records;
# time from `billed_until` on is not yet recorded. `next_window_end` is the next hourly boundary the
# window closer waits for (indexed for the FOR UPDATE SKIP LOCKED claim).
meters = Table(
    "meters",
    metadata,
    Column("allocation_id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("project_id", UUID(as_uuid=True), nullable=False),
    Column("host_id", UUID(as_uuid=True)),
    Column("shape", Text, nullable=False),
    Column("gpu_model", Text, nullable=False),
    Column("gpu_count", Integer, nullable=False),
    Column("status", Text, nullable=False),  # open | suspended | closed
    Column("opened_at", DateTime(timezone=True), nullable=False),
    Column("changed_at", DateTime(timezone=True)),
    Column("closed_at", DateTime(timezone=True)),
    Column("close_reason", Text),
    Column("suspended_at", DateTime(timezone=True)),
    Column("suspend_reason", Text),
    Column("resumed_at", DateTime(timezone=True)),
    Column("billed_until", DateTime(timezone=True), nullable=False),
    Column("next_window_end", DateTime(timezone=True)),
    # GPU-seconds recorded before a stop that arrived after the window had already been closed (see README).
    Column("late_stop_gpu_seconds", Numeric(20, 6), nullable=False, server_default="0"),
    Column("allocation_version", Integer, nullable=False),
    Column("version", Integer, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("status IN ('open', 'suspended', 'closed')", name="status"),
    CheckConstraint("gpu_count >= 1", name="gpu_count"),
    CheckConstraint("billed_until >= opened_at", name="billed_after_open"),
)
Index("ix_meters_due", meters.c.next_window_end, postgresql_where=meters.c.status == "open")
Index("ix_meters_host", meters.c.host_id)
Index("ix_meters_project", meters.c.project_id)

# Usage records are facts: the primary key is the deterministic usage_record_id(allocation, window_start),
# so a recomputed or replayed window can never become a second record.
usage_records = Table(
    "usage_records",
    metadata,
    Column("usage_record_id", UUID(as_uuid=True), primary_key=True),
    Column("allocation_id", UUID(as_uuid=True), nullable=False),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("project_id", UUID(as_uuid=True), nullable=False),
    Column("host_id", UUID(as_uuid=True)),
    Column("shape", Text, nullable=False),
    Column("gpu_model", Text, nullable=False),
    Column("gpu_count", Integer, nullable=False),
    Column("window_start", DateTime(timezone=True), nullable=False),
    Column("window_end", DateTime(timezone=True), nullable=False),
    Column("gpu_seconds", Numeric(20, 6), nullable=False),
    Column("final", Boolean, nullable=False, server_default="false"),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("instance_id", UUID(as_uuid=True)),  # the app instance on the allocation in the window, if one
    CheckConstraint("window_end > window_start", name="window_order"),
)
Index("ix_usage_records_allocation", usage_records.c.allocation_id, usage_records.c.window_start, unique=True)

app_usage_records = Table(
    "app_usage_records",
    metadata,
    Column("app_usage_record_id", UUID(as_uuid=True), primary_key=True),
    Column("instance_id", UUID(as_uuid=True), nullable=False),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("project_id", UUID(as_uuid=True), nullable=False),
    Column("app_slug", Text, nullable=False),
    Column("member_id", UUID(as_uuid=True)),
    Column("unit", Text, nullable=False),
    Column("quantity", Numeric(24, 6), nullable=False),
    Column("idempotency_key", Text, nullable=False),
    Column("occurred_at", DateTime(timezone=True), nullable=False),
    Column("reported_by", Text),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("quantity >= 0", name="quantity"),
)
Index("ix_app_usage_records_instance", app_usage_records.c.instance_id, app_usage_records.c.occurred_at)

# Projection of allocations' hosts: only what the heartbeat rule needs.
hosts = Table(
    "hosts",
    metadata,
    Column("host_id", UUID(as_uuid=True), primary_key=True),
    Column("name", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("last_heartbeat_at", DateTime(timezone=True)),
    Column("lost_since", DateTime(timezone=True)),  # set by host.heartbeat_lost, cleared on recovery
    Column("version", Integer, nullable=False),
)

# Projection of app-runtime's members: an app usage report naming a member must name one of its instance;
# a GPU window of an allocation is attributed to the one instance whose members ran on it (joined/left).
members = Table(
    "members",
    metadata,
    Column("member_id", UUID(as_uuid=True), primary_key=True),
    Column("instance_id", UUID(as_uuid=True), nullable=False),
    Column("version", Integer, nullable=False),
    Column("allocation_id", UUID(as_uuid=True)),
    Column("joined_at", DateTime(timezone=True)),
    Column("left_at", DateTime(timezone=True)),
)
Index("ix_members_allocation", members.c.allocation_id)

# Projection of app-runtime's instances: who an app usage event is attributed to, and its lifetime.
instances = Table(
    "instances",
    metadata,
    Column("instance_id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("project_id", UUID(as_uuid=True), nullable=False),
    Column("app_slug", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("ended_at", DateTime(timezone=True)),
    Column("version", Integer, nullable=False),
    # Launchable apps (issue 21): app-hours are metered from `running_since` to the end, per hourly window,
    # recorded up to `app_hours_until` (migration metering_0005).
    Column("launchable", Boolean, nullable=False, server_default="false"),
    Column("running_since", DateTime(timezone=True)),
    Column("app_hours_until", DateTime(timezone=True)),
)
