"""`gpuaas.allocations.v1`: hosts, allocations, SSH grants and volumes (owner: allocations).

Event-carried state transfer: every event holds the full current state of its entity, keyed by
the entity id, so app-runtime (placement), metering (meters) and any new consumer can rebuild
their projections from the (compacted) topic alone. `version` increases with every change of
an entity: a projection applies an event only if it is newer than what it holds.

Metering reads the lifecycle times carried here (`activated_at`, `billing_stopped_at`,
`status_changed_at`) rather than the envelope time, so a late publish never shifts a bill.
"""

# Each event class narrows the envelope's `type: str` to its own Literal (the discriminator of its topic's
# union): pydantic's way, which the checker calls an incompatible override of a mutable field.
# pyright: reportIncompatibleVariableOverride=false
from __future__ import annotations

import uuid
from enum import StrEnum
from typing import Literal

from pydantic import Field

from gpuaas.contracts.enums import AllocationStatus, CapacityShape, PendingReason
from gpuaas.contracts.envelope import Event, Payload
from gpuaas.contracts.scalars import Digest, PinnedRef, Timestamp


class HostStatus(StrEnum):
    """enrolling (agent registered, host setup running) → ready; cordoned takes no new
    allocations; unreachable after lost heartbeats; decommissioned is final."""

    enrolling = "enrolling"
    ready = "ready"
    cordoned = "cordoned"
    unreachable = "unreachable"
    decommissioned = "decommissioned"


class GpuDevice(Payload):
    index: int = Field(ge=0, description="device index on the host (CUDA_VISIBLE_DEVICES)")
    model: str = Field(description="normalised model name, e.g. 'H100-80GB'")
    memory_mb: int = Field(ge=0)
    device_uuid: str | None = Field(default=None, description="vendor device UUID when discovered")


class HostState(Payload):
    aggregate_field = "host_id"

    host_id: uuid.UUID
    name: str
    status: HostStatus
    host_class: str | None = Field(default=None, description="operator-defined class a request may pin")
    labels: dict[str, str] = Field(default_factory=dict)
    gpus: list[GpuDevice] = Field(default_factory=list)
    inventory_source: Literal["nvidia-smi", "declared"] = "declared"
    agent_version: str | None = None
    last_heartbeat_at: Timestamp | None = None
    cordon_reason: str | None = None
    version: int = Field(ge=1)
    driver: Literal["container", "process"] | None = Field(
        default=None, description="the agent's runtime driver (None until an agent that reports it registers)"
    )
    isolates_tenants: bool = Field(default=False, description="the driver separates tenants sharing the host")
    shared_tenancy_allowed: bool = Field(
        default=False, description="operator override: several tenants may share this host although it does not isolate"
    )
    cpu_count: int | None = Field(default=None, ge=0)
    memory_mb: int | None = Field(default=None, ge=0)
    ssh_host_key_fingerprint: str | None = Field(
        default=None, description="SHA256 fingerprint of the pinned SSH host key of the agent's endpoint"
    )


class RuntimeRef(Payload):
    """The runtime image an allocation's container runs, pinned by digest (a catalog `runtime` artifact)."""

    slug: str
    version: str
    image: PinnedRef
    digest: Digest


class WorkloadSpec(Payload):
    """A launchable app's workload, started by the node agent in the allocation's container (issue 21).

    From the app's manifest (`runtime_profile`): the command (run as the allocation's user), the port it
    serves HTTP on inside the container and its health path. The agent publishes the port on the host's
    enrolled address and passes the platform's per-instance secret in `auth_env` (never in an event: the
    agent's task carries it); the gateway's `/apps/{instance_id}/` is the only way in."""

    instance_id: uuid.UUID
    command: list[str] = Field(default_factory=list, description="argv; empty: the image's own command")
    port: int = Field(ge=1, le=65535, description="the workload's HTTP port inside the container")
    health_path: str = Field(default="/", description="relative to base_path; answered 2xx/3xx when ready")
    base_path: str = Field(description="the URL prefix the gateway serves it under: /apps/<instance_id>/")
    env: dict[str, str] = Field(default_factory=dict)
    auth_env: str | None = Field(
        default=None, description="environment variable the workload reads the per-instance secret from"
    )
    auth_header: str = Field(default="Authorization", description="request header the gateway puts the secret in")
    auth_scheme: str = Field(default="token", description="prefix of the header value ('token <secret>')")


class WorkloadEndpoint(Payload):
    """Where a launchable workload answers: the ENROLLED host's address (never the agent's report) and the
    host port the agent published it on; `healthy` once its health check answered."""

    host: str
    port: int = Field(ge=1, le=65535)
    healthy: bool = False


class AllocationLimits(Payload):
    """Resource limits of an allocation's container (from its host class, else its share of the host)."""

    cpus: float = Field(gt=0)
    memory_mb: int = Field(ge=1)
    pids: int = Field(ge=1)


class SshEndpoint(Payload):
    host: str
    port: int = Field(ge=1, le=65535)
    username: str = Field(description="the allocation's Unix account")


class PreemptionNotice(Payload):
    """A preemption scheduled for an allocation (issue 29): it stops at `deadline` (SIGTERM, then SIGKILL after
    the stop timeout) and its GPUs go to `for_allocation_id`; `on_preemption` says what happens to it then."""

    deadline: Timestamp
    reason: str = Field(max_length=64, description="e.g. reclaim_guarantee")
    for_allocation_id: uuid.UUID = Field(description="the waiting request the GPUs are freed for")
    on_preemption: Literal["requeue", "release"] = "release"
    scheduled_at: Timestamp


class AllocationState(Payload):
    aggregate_field = "allocation_id"

    allocation_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    owner_user_id: uuid.UUID | None = Field(
        default=None, description="user who created it; None when a service account did"
    )
    name: str = ""
    shape: CapacityShape
    gpu_model: str
    gpu_count: int = Field(ge=1)
    gpu_indices: list[int] = Field(default_factory=list, description="assigned GPU indices on the host")
    host_id: uuid.UUID | None = Field(default=None, description="None until placed")
    host_class: str | None = None
    status: AllocationStatus
    status_changed_at: Timestamp = Field(description="when the allocation entered `status`")
    failure_reason: str | None = Field(default=None, description="why it failed / release failed")
    target_gpu_count: int | None = Field(default=None, ge=1, description="gpu count of a resize in flight")
    ssh_endpoint: SshEndpoint | None = None
    volume_ids: list[uuid.UUID] = Field(default_factory=list)
    requested_at: Timestamp
    activated_at: Timestamp | None = None
    release_requested_at: Timestamp | None = None
    billing_stopped_at: Timestamp | None = Field(
        default=None, description="set at the release request: billing stops even if the release fails"
    )
    released_at: Timestamp | None = None
    release_attempts: int = Field(default=0, ge=0)
    attention: str | None = Field(
        default=None, description="a visible condition that needs attention, e.g. the host stopped heartbeating"
    )
    version: int = Field(ge=1)
    runtime: RuntimeRef | None = Field(default=None, description="None on a process-driver host")
    driver: Literal["container", "process"] | None = Field(default=None, description="the host's driver when placed")
    limits: AllocationLimits | None = None
    workload: WorkloadSpec | None = Field(default=None, description="the launchable workload it runs, if any")
    workload_endpoint: WorkloadEndpoint | None = Field(
        default=None, description="set when the workload's health check answered (active allocations)"
    )
    pending_reason: PendingReason | None = Field(default=None, description="why a `queued` allocation waits")
    queue_position: int | None = Field(
        default=None, ge=1, description="1-based place in its project's queue (priority, then age) while queued"
    )
    priority: int = Field(default=0, ge=-100, le=100, description="order inside its project's queue (higher first)")
    max_wait_s: int | None = Field(default=None, ge=1, description="a queued request fails after waiting this long")
    preemption: PreemptionNotice | None = Field(
        default=None, description="set from the preemption notice until the stop (issue 29)"
    )
    requeued_from: uuid.UUID | None = Field(
        default=None,
        description="the allocation this request re-runs: a preempted one (on_preemption=requeue) or one restarted "
        "after its host was lost (unreachable or decommissioned)",
    )
    pending_resize_gpus: int | None = Field(
        default=None,
        ge=1,
        description="a resize up that waits for GPUs on its host (the size asked); it keeps its current GPUs meanwhile",
    )
    pending_resize_reason: PendingReason | None = Field(
        default=None, description="why the pending resize waits (`no_capacity` on its host, `over_limit`, ...)"
    )


class CapacityQueueState(Payload):
    """A capacity queue of one pool (GPU model): a tenant's (set by operators) or a project's (set by its
    tenant's admins, inside the tenant's share). GPUs: `guarantee` whenever it asks, at most `limit`
    (borrowing included; None: no limit), at most `lend_limit` of its unused guarantee lent to others
    (None: all of it); `weight` divides the borrowable surplus among siblings."""

    aggregate_field = "queue_id"

    queue_id: uuid.UUID
    scope: Literal["tenant", "project"]
    scope_id: uuid.UUID = Field(description="the tenant's or the project's id")
    tenant_id: uuid.UUID
    project_id: uuid.UUID | None = Field(default=None, description="set on a project queue")
    gpu_model: str
    guarantee: int = Field(ge=0)
    limit: int | None = Field(default=None, ge=0)
    lend_limit: int | None = Field(default=None, ge=0)
    weight: float = Field(gt=0)
    version: int = Field(ge=1)
    updated_at: Timestamp


class SshGrantState(Payload):
    """SSH access to one allocation with the grantee's own public key.

    `origin` tells a project member's grant from a key installed for an app instance's
    controller (app-runtime access grant).
    """

    aggregate_field = "grant_id"

    grant_id: uuid.UUID
    allocation_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    origin: Literal["user", "app_access_grant"] = "user"
    user_id: uuid.UUID | None = Field(default=None, description="grantee (origin=user)")
    access_grant_id: uuid.UUID | None = Field(default=None, description="source grant (origin=app_access_grant)")
    public_key: str = Field(description="OpenSSH public key line")
    fingerprint: str = Field(description="SHA256 fingerprint of public_key")
    status: Literal["active", "revoked"] = "active"
    granted_by: str | None = Field(default=None, description="actor id that created the grant")
    created_at: Timestamp
    revoked_at: Timestamp | None = None
    version: int = Field(ge=1)


class VolumeAttachment(Payload):
    allocation_id: uuid.UUID
    mount_path: str
    attached_at: Timestamp


class VolumeState(Payload):
    """A project volume; `persist` says what survives the release of an allocation."""

    aggregate_field = "volume_id"

    volume_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    name: str
    size_gb: int = Field(ge=1)
    persist: bool = Field(description="data survives release of the allocations it is attached to")
    access_mode: Literal["single_writer", "multi_attach"] = "single_writer"
    status: Literal["available", "attached", "deleted"] = "available"
    attachments: list[VolumeAttachment] = Field(default_factory=list)
    version: int = Field(ge=1)


class HostEnrolled(Event):
    """An agent registered a host; it becomes schedulable once `ready`."""

    type: Literal["host.enrolled"] = "host.enrolled"
    data: HostState


class HostUpdated(Event):
    """Inventory, labels, class or status changed (including uncordon and heartbeat recovery)."""

    type: Literal["host.updated"] = "host.updated"
    data: HostState


class HostCordoned(Event):
    """The host takes no new allocations; existing ones keep running."""

    type: Literal["host.cordoned"] = "host.cordoned"
    data: HostState


class HostHeartbeatLost(Event):
    """The agent missed its heartbeats; the host is `unreachable`."""

    type: Literal["host.heartbeat_lost"] = "host.heartbeat_lost"
    data: HostState


class AllocationRequested(Event):
    """A tenant asked for capacity; not yet placed."""

    type: Literal["allocation.requested"] = "allocation.requested"
    data: AllocationState


class AllocationQueued(Event):
    """No capacity (or its project/tenant is at its limit) now: the request waits in its queue, holding no
    GPUs, with `pending_reason` and `queue_position`; admission moves it on with `allocation.provisioning`."""

    type: Literal["allocation.queued"] = "allocation.queued"
    data: AllocationState


class AllocationProvisioning(Event):
    """Placed on a host (GPUs reserved); the agent is setting up the account and workspace."""

    type: Literal["allocation.provisioning"] = "allocation.provisioning"
    data: AllocationState


class AllocationActivated(Event):
    """Ready for use: SSH endpoint set. Metering opens a meter at `activated_at`."""

    type: Literal["allocation.activated"] = "allocation.activated"
    data: AllocationState


class AllocationRestarting(Event):
    """Restart-in-place started: same id, host, endpoint, keys and volumes; sessions interrupted."""

    type: Literal["allocation.restarting"] = "allocation.restarting"
    data: AllocationState


class AllocationRestarted(Event):
    """Restart finished; the allocation is `active` again."""

    type: Literal["allocation.restarted"] = "allocation.restarted"
    data: AllocationState


class AllocationRestartFailed(Event):
    """Restart did not complete; `failure_reason` says why, `status` where it now stands."""

    type: Literal["allocation.restart_failed"] = "allocation.restart_failed"
    data: AllocationState


class AllocationResizing(Event):
    """A resize to `target_gpu_count` started."""

    type: Literal["allocation.resizing"] = "allocation.resizing"
    data: AllocationState


class AllocationResized(Event):
    """Resize finished: `gpu_count`/`gpu_indices` are the new ones. Metering changes the meter."""

    type: Literal["allocation.resized"] = "allocation.resized"
    data: AllocationState


class AllocationResizeFailed(Event):
    """Resize did not complete; the allocation keeps its previous GPUs (`failure_reason`)."""

    type: Literal["allocation.resize_failed"] = "allocation.resize_failed"
    data: AllocationState


class AllocationReleaseRequested(Event):
    """Release asked (or retried): `releasing`; billing stops at `billing_stopped_at`.

    App-runtime stops the members on the allocation first and answers with
    `release_clearance.granted` on `gpuaas.app-runtime.v1`.
    """

    type: Literal["allocation.release_requested"] = "allocation.release_requested"
    data: AllocationState


class AllocationReleased(Event):
    """Released: GPUs freed, account removed, non-persistent volumes gone."""

    type: Literal["allocation.released"] = "allocation.released"
    data: AllocationState


class AllocationFailed(Event):
    """Provisioning failed (`failure_reason`); it never became active and was never billed."""

    type: Literal["allocation.failed"] = "allocation.failed"
    data: AllocationState


class AllocationReleaseFailed(Event):
    """Release failed (`failure_reason`); billing has stopped regardless; release can be retried."""

    type: Literal["allocation.release_failed"] = "allocation.release_failed"
    data: AllocationState


class AllocationAttentionChanged(Event):
    """`attention` was set or cleared (e.g. its host stopped or resumed heartbeating); status unchanged."""

    type: Literal["allocation.attention_changed"] = "allocation.attention_changed"
    data: AllocationState


class AllocationPreemptionScheduled(Event):
    """The allocation will be preempted: `preemption` holds the deadline, the reason and the request its GPUs
    are freed for. Its SSH sessions and a file in it (/run/gpuaas/preemption) carry the same notice; at the
    deadline it is stopped (`allocation.release_requested` ... `allocation.released`; billing stops there)."""

    type: Literal["allocation.preemption_scheduled"] = "allocation.preemption_scheduled"
    data: AllocationState


class AllocationPreemptionCancelled(Event):
    """A scheduled preemption was called off at its deadline (the request it was for no longer waits): the
    allocation runs on, `preemption` cleared."""

    type: Literal["allocation.preemption_cancelled"] = "allocation.preemption_cancelled"
    data: AllocationState


class AllocationResizeQueued(Event):
    """A resize up cannot be granted on its host now: it waits (`pending_resize_gpus`,
    `pending_resize_reason`) while the allocation runs on with its current GPUs; admission grants it with
    `allocation.resizing`."""

    type: Literal["allocation.resize_queued"] = "allocation.resize_queued"
    data: AllocationState


class AllocationResizeCancelled(Event):
    """A waiting resize was cancelled (by its owner, or by the allocation's release); nothing changed on the host."""

    type: Literal["allocation.resize_cancelled"] = "allocation.resize_cancelled"
    data: AllocationState


class CapacityQueueUpdated(Event):
    """A capacity queue's settings were set or changed (audited with the change)."""

    type: Literal["capacity_queue.updated"] = "capacity_queue.updated"
    data: CapacityQueueState


class SshGrantCreated(Event):
    """A public key was granted access to an allocation."""

    type: Literal["ssh_grant.created"] = "ssh_grant.created"
    data: SshGrantState


class SshGrantRevoked(Event):
    """The key is removed from the allocation."""

    type: Literal["ssh_grant.revoked"] = "ssh_grant.revoked"
    data: SshGrantState


class VolumeCreated(Event):
    """A project volume exists (not yet attached)."""

    type: Literal["volume.created"] = "volume.created"
    data: VolumeState


class VolumeAttached(Event):
    """The volume was mounted on an allocation (see `attachments`)."""

    type: Literal["volume.attached"] = "volume.attached"
    data: VolumeState


class VolumeDetached(Event):
    """The volume was unmounted from an allocation (explicitly or at release)."""

    type: Literal["volume.detached"] = "volume.detached"
    data: VolumeState


class VolumeDeleted(Event):
    """The volume and its data are gone."""

    type: Literal["volume.deleted"] = "volume.deleted"
    data: VolumeState


EVENTS: tuple[type[Event], ...] = (
    HostEnrolled,
    HostUpdated,
    HostCordoned,
    HostHeartbeatLost,
    AllocationRequested,
    AllocationProvisioning,
    AllocationActivated,
    AllocationRestarting,
    AllocationRestarted,
    AllocationRestartFailed,
    AllocationResizing,
    AllocationResized,
    AllocationResizeFailed,
    AllocationReleaseRequested,
    AllocationReleased,
    AllocationFailed,
    AllocationReleaseFailed,
    AllocationAttentionChanged,
    AllocationQueued,
    AllocationPreemptionScheduled,
    AllocationPreemptionCancelled,
    AllocationResizeQueued,
    AllocationResizeCancelled,
    CapacityQueueUpdated,
    SshGrantCreated,
    SshGrantRevoked,
    VolumeCreated,
    VolumeAttached,
    VolumeDetached,
    VolumeDeleted,
)
