"""Allocations' tables (schema `allocations`).

Capacity is guarded by `gpu_assignments`: its primary key (host_id, gpu_index) makes a GPU
impossible to hand out twice, whatever the placement code does; placement additionally locks the
host row so concurrent requests queue instead of failing on the key.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

from gpuaas.kit.db import NAMING_CONVENTION

metadata = MetaData(naming_convention=NAMING_CONVENTION)

hosts = Table(
    "hosts",
    metadata,
    Column("host_id", UUID(as_uuid=True), primary_key=True),
    Column("name", Text, nullable=False, unique=True),
    Column("status", Text, nullable=False),
    Column("host_class", Text),
    Column("labels", JSONB, nullable=False, server_default="{}"),
    Column("gpus", JSONB, nullable=False, server_default="[]"),
    # Only a hash of the node token is kept; the agent presents the token to register.
    Column("node_token_hash", Text, nullable=False),
    Column("version", Integer, nullable=False, server_default="1"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("inventory_source", Text, nullable=False, server_default="declared"),
    Column("agent_version", Text),
    Column("last_heartbeat_at", DateTime(timezone=True)),
    Column("cordon_reason", Text),
    # Where the agent's SSH endpoint listens (host sshd or the agent's own asyncssh server).
    Column("ssh_host", Text),
    Column("ssh_port", Integer),
    # Status to return to when heartbeats resume (ready or cordoned).
    Column("status_before_unreachable", Text),
    # What the agent reports at registration: its runtime driver and whether it separates tenants.
    Column("driver", Text),
    Column("isolates_tenants", Boolean, nullable=False, server_default="false"),
    # Operator override (audited): several tenants may share this host although it does not isolate them.
    Column("shared_tenancy_allowed", Boolean, nullable=False, server_default="false"),
    Column("cpu_count", Integer),
    Column("memory_mb", Integer),
    # The SSH host key of the agent's endpoint, pinned at enrolment or first registration (ssh_host and
    # ssh_port likewise): a later registration cannot move them; an operator re-enrolment resets them.
    Column("ssh_host_key", Text),
    Column("ssh_host_key_fingerprint", Text),
)

# Operator-defined host classes: the default runtime of allocations placed on their hosts and the
# resource figures per GPU their containers are limited to.
host_classes = Table(
    "host_classes",
    metadata,
    Column("name", Text, primary_key=True),
    Column("default_runtime", Text),
    Column("cpus_per_gpu", Float),
    Column("memory_mb_per_gpu", Integer),
    Column("pids_limit", Integer, nullable=False, server_default="4096"),
    Column("version", Integer, nullable=False, server_default="1"),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# Projection of the catalog topic: manifests of kind `runtime` and the artifacts they pin. Allocation
# create resolves its `runtime` here (no call to catalog); newer counters win (revision / version).
catalog_runtimes = Table(
    "catalog_runtimes",
    metadata,
    Column("manifest_id", UUID(as_uuid=True), primary_key=True),
    Column("slug", Text, nullable=False, index=True),
    Column("app_version", Text, nullable=False),
    Column("display_name", Text, nullable=False, server_default=""),
    Column("active", Boolean, nullable=False),
    Column("deprecated", Boolean, nullable=False),
    Column("artifact_ref", Text, nullable=False),
    Column("artifact_id", UUID(as_uuid=True)),
    Column("revision", Integer, nullable=False),
)

catalog_artifacts = Table(
    "catalog_artifacts",
    metadata,
    Column("artifact_id", UUID(as_uuid=True), primary_key=True),
    Column("ref", Text, nullable=False, index=True),
    Column("digest", Text, nullable=False, index=True),
    Column("state", Text, nullable=False),
    Column("canary_tenants", JSONB, nullable=False, server_default="[]"),
    Column("version", Integer, nullable=False),
)

allocations = Table(
    "allocations",
    metadata,
    Column("allocation_id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("project_id", UUID(as_uuid=True), nullable=False, index=True),
    Column("owner_user_id", UUID(as_uuid=True)),
    Column("name", Text, nullable=False, server_default=""),
    Column("shape", Text, nullable=False),
    Column("gpu_model", Text, nullable=False),
    Column("gpu_count", Integer, nullable=False),
    Column("gpu_indices", JSONB, nullable=False, server_default="[]"),
    Column("host_id", UUID(as_uuid=True), ForeignKey("hosts.host_id"), index=True),
    Column("host_class", Text),
    Column("status", Text, nullable=False),
    Column("status_changed_at", DateTime(timezone=True), nullable=False),
    Column("failure_reason", Text),
    Column("target_gpu_count", Integer),
    Column("target_gpu_indices", JSONB),
    Column("ssh_username", Text, nullable=False),
    Column("ssh_host", Text),
    Column("ssh_port", Integer),
    Column("requested_at", DateTime(timezone=True), nullable=False),
    Column("activated_at", DateTime(timezone=True)),
    Column("release_requested_at", DateTime(timezone=True)),
    Column("billing_stopped_at", DateTime(timezone=True)),
    Column("released_at", DateTime(timezone=True)),
    Column("release_attempts", Integer, nullable=False, server_default="0"),
    Column("attention", Text),
    # Release saga: set while waiting for app-runtime's release clearance (members on it).
    Column("awaiting_clearance_since", DateTime(timezone=True)),
    Column("version", Integer, nullable=False, server_default="1"),
    # The runtime image ({slug, version, image, digest}) and limits of the container (null on a
    # process-driver host), the host's driver, and what the agent checked at release.
    Column("runtime", JSONB),
    Column("driver", Text),
    Column("limits", JSONB),
    Column("release_evidence", JSONB),
    Column("network", JSONB),  # where the project's other allocations reach it (agent-reported; container hosts)
    # The capacity queue (issue 29): why and where a `queued` request waits, its order inside its project's
    # queue, when it gives up, what happens to it when preempted, and the runtime it asked for (resolved
    # against its host at admission).
    Column("pending_reason", Text),
    Column("queue_position", Integer),
    Column("priority", Integer, nullable=False, server_default="0"),
    Column("max_wait_s", Integer),
    Column("enqueued_at", DateTime(timezone=True)),
    Column("on_preemption", Text, nullable=False, server_default="release"),
    Column("requested_runtime", Text),
    # Preemption with notice (issue 29): when a scheduled preemption stops it, for which waiting request, why;
    # `preempted_for` stays after the stop until that request is admitted (the freed GPUs are held for it).
    # A requeued victim's new request names the stopped allocation in `requeued_from`.
    Column("preempt_deadline", DateTime(timezone=True)),
    Column("preempted_for", UUID(as_uuid=True)),
    Column("preemption_reason", Text),
    Column("preemption_scheduled_at", DateTime(timezone=True)),
    Column("requeued_from", UUID(as_uuid=True)),
    # A waiting request's estimated start, where one can be computed: GPUs are being freed for it by
    # preemption (its victims' latest deadline plus their stop timeout). Shown only while it is queued.
    Column("estimated_start_at", DateTime(timezone=True)),
    # A resize up that waits for GPUs on its own host (issue 29): the size asked, why it waits, since when. The
    # allocation keeps running with its current GPUs meanwhile; admission grants it (-> resizing).
    Column("pending_resize_gpus", Integer),
    Column("pending_resize_reason", Text),
    Column("pending_resize_since", DateTime(timezone=True)),
    # The list endpoints: newest first, per project or across the principal's projects.
    Index("ix_allocations_project_requested", "project_id", text("requested_at DESC"), text("allocation_id DESC")),
    Index("ix_allocations_requested", text("requested_at DESC"), text("allocation_id DESC")),
    # The admission runner's read: the waiting requests of one pool.
    Index("ix_allocations_queued", "gpu_model", "enqueued_at", postgresql_where=text("status = 'queued'")),
    Index("ix_allocations_preempt_deadline", "preempt_deadline", postgresql_where=text("preempt_deadline IS NOT NULL")),
    Index("ix_allocations_preempted_for", "preempted_for", postgresql_where=text("preempted_for IS NOT NULL")),
    Index("ix_allocations_pending_resize", "gpu_model", postgresql_where=text("pending_resize_gpus IS NOT NULL")),
)

gpu_assignments = Table(
    "gpu_assignments",
    metadata,
    Column("host_id", UUID(as_uuid=True), ForeignKey("hosts.host_id"), primary_key=True),
    Column("gpu_index", Integer, primary_key=True),
    Column("allocation_id", UUID(as_uuid=True), ForeignKey("allocations.allocation_id"), nullable=False, index=True),
)

# Per host and GPU model: the model's indices on the host, their count and how many are assigned.
# Maintained by triggers on hosts (gpus) and gpu_assignments (migration allocations_0005), never
# written by the service: placement reads its candidates here instead of every assignment.
host_capacity = Table(
    "host_capacity",
    metadata,
    Column("host_id", UUID(as_uuid=True), ForeignKey("hosts.host_id", ondelete="CASCADE"), primary_key=True),
    Column("gpu_model", Text, primary_key=True),
    Column("indices", ARRAY(Integer), nullable=False),
    Column("total", Integer, nullable=False),
    Column("used", Integer, nullable=False),
    Index("ix_host_capacity_model_free", "gpu_model", text("(total - used)")),
)

timeline = Table(
    "timeline",
    metadata,
    Column("seq", BigInteger, Identity(), primary_key=True),
    Column("entry_id", UUID(as_uuid=True), nullable=False, unique=True),
    Column("allocation_id", UUID(as_uuid=True), nullable=False),
    Column("phase", Text, nullable=False),
    Column("status", Text, nullable=False),  # started | succeeded | failed | info
    Column("message", Text, nullable=False, server_default=""),
    Column("task_id", UUID(as_uuid=True)),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("finished_at", DateTime(timezone=True)),
    Index("ix_timeline_allocation_seq", "allocation_id", "seq"),
)

agent_tasks = Table(
    "agent_tasks",
    metadata,
    Column("seq", BigInteger, Identity(), primary_key=True),
    Column("task_id", UUID(as_uuid=True), nullable=False, unique=True),
    Column("host_id", UUID(as_uuid=True), ForeignKey("hosts.host_id"), nullable=False),
    Column("allocation_id", UUID(as_uuid=True)),
    Column("kind", Text, nullable=False),
    Column("payload", JSONB, nullable=False, server_default="{}"),
    Column("status", Text, nullable=False),  # pending | leased | succeeded | failed
    Column("lease_token", UUID(as_uuid=True)),
    Column("lease_expires_at", DateTime(timezone=True)),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("result", JSONB),
    Column("error", Text),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("finished_at", DateTime(timezone=True)),
    Index("ix_agent_tasks_open", "host_id", "seq", postgresql_where=text("status IN ('pending', 'leased')")),
)

ssh_keys = Table(
    "ssh_keys",
    metadata,
    Column("key_id", UUID(as_uuid=True), primary_key=True),
    Column("user_id", UUID(as_uuid=True), nullable=False, index=True),
    Column("name", Text, nullable=False),
    Column("public_key", Text, nullable=False),
    Column("fingerprint", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("uq_ssh_keys_user_fingerprint", "user_id", "fingerprint", unique=True),
)

ssh_grants = Table(
    "ssh_grants",
    metadata,
    Column("grant_id", UUID(as_uuid=True), primary_key=True),
    Column("allocation_id", UUID(as_uuid=True), ForeignKey("allocations.allocation_id"), nullable=False, index=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("project_id", UUID(as_uuid=True), nullable=False),
    Column("origin", Text, nullable=False),
    Column("user_id", UUID(as_uuid=True)),
    Column("access_grant_id", UUID(as_uuid=True)),
    Column("public_key", Text, nullable=False),
    Column("fingerprint", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("granted_by", Text),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("revoked_at", DateTime(timezone=True)),
    Column("version", Integer, nullable=False, server_default="1"),
)

volumes = Table(
    "volumes",
    metadata,
    Column("volume_id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("project_id", UUID(as_uuid=True), nullable=False, index=True),
    Column("name", Text, nullable=False),
    Column("size_gb", Integer, nullable=False),
    Column("persist", Boolean, nullable=False),
    Column("access_mode", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("version", Integer, nullable=False, server_default="1"),
)

volume_attachments = Table(
    "volume_attachments",
    metadata,
    Column("volume_id", UUID(as_uuid=True), ForeignKey("volumes.volume_id"), primary_key=True),
    Column("allocation_id", UUID(as_uuid=True), ForeignKey("allocations.allocation_id"), primary_key=True),
    Column("mount_path", Text, nullable=False),
    Column("exclusive", Boolean, nullable=False),
    Column("attached_at", DateTime(timezone=True), nullable=False),
    # A single_writer volume has at most one attachment, whatever races the API loses.
    Index("uq_volume_attachments_single_writer", "volume_id", unique=True, postgresql_where=text("exclusive")),
    Index("ix_volume_attachments_allocation", "allocation_id"),  # the primary key leads with volume_id
)

quotas = Table(
    "quotas",
    metadata,
    Column("project_id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("max_gpus", Integer, nullable=False),
    Column("version", Integer, nullable=False, server_default="1"),
)

# Capacity queues (issue 29), per pool (GPU model): a tenant's (operators set it) or a project's (its tenant's
# admins divide the tenant's share). A project's GPU quota (`quotas`) still caps it across models.
capacity_queues = Table(
    "capacity_queues",
    metadata,
    Column("queue_id", UUID(as_uuid=True), primary_key=True),
    Column("scope", Text, nullable=False),  # 'tenant' | 'project'
    Column("scope_id", UUID(as_uuid=True), nullable=False),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("gpu_model", Text, nullable=False),
    Column("guarantee", Integer, nullable=False, server_default="0"),
    Column("limit", Integer),
    Column("lend_limit", Integer),
    Column("weight", Float, nullable=False, server_default="1"),
    Column("version", Integer, nullable=False, server_default="1"),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("uq_capacity_queues_scope_model", "scope", "scope_id", "gpu_model", unique=True),
    Index("ix_capacity_queues_model_tenant", "gpu_model", "tenant_id"),
)

# Projection of app-runtime members (which allocations have app members that must stop first).
app_members = Table(
    "app_members",
    metadata,
    Column("member_id", UUID(as_uuid=True), primary_key=True),
    Column("allocation_id", UUID(as_uuid=True), nullable=False, index=True),
    Column("status", Text, nullable=False),
    Column("tombstoned", Boolean, nullable=False),
    Column("version", Integer, nullable=False),
)

# The platform SSH CA: signs the short-lived certificates of browser terminal sessions.
platform_keys = Table(
    "platform_keys",
    metadata,
    Column("name", Text, primary_key=True),
    Column("private_key", Text, nullable=False),
    Column("public_key", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)
