"""`gpuaas.app-runtime.v1`: app instances, members, member operations, access grants (owner: app-runtime).

Full state per event, keyed by entity id (compacted). Consumers:
- catalog projects `InstanceState.artifact_digest` of live instances (retire gate);
- allocations installs `AccessGrantState.public_key` on the listed allocations, and proceeds
  with a release once `release_clearance.granted` says the members on it are stopped (saga);
- metering attributes app usage to instances.

Adapter-owned semantics (component keys, runtime detail, config) stay opaque here: the
platform defines the generic lifecycle, not a topology DSL.
"""

# Each event class narrows the envelope's `type: str` to its own Literal (the discriminator of its topic's
# union): pydantic's way, which the checker calls an incompatible override of a mutable field.
# pyright: reportIncompatibleVariableOverride=false
from __future__ import annotations

import uuid
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field

from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.envelope import Event, Payload
from gpuaas.contracts.scalars import Digest, Timestamp


class MemberStatus(StrEnum):
    pending = "pending"
    starting = "starting"
    active = "active"
    draining = "draining"
    stopping = "stopping"
    stopped = "stopped"
    removed = "removed"
    failed = "failed"


class OperationKind(StrEnum):
    add = "add"
    drain = "drain"
    remove = "remove"
    replace = "replace"  # pyright: ignore[reportAssignmentType]  # shadows the str method
    recover = "recover"


class OperationStatus(StrEnum):
    """pending → claimed (lease) → in_progress → succeeded | failed | cancelled.

    An expired lease (or an operator retry) puts the operation back to `pending`.
    """

    pending = "pending"
    claimed = "claimed"
    in_progress = "in_progress"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


class PlacementIntent(Payload):
    """Which allocations the instance runs on; realised on hosts by allocations, not here.

    `launch` (launchable apps): the deploy asks for a NEW allocation of `gpu_count` x `gpu_model` that runs
    the app's workload (see InstanceState.launch); its id is chosen at deploy (`launch_allocation_id`)."""

    mode: Literal["same_node", "split", "launch"] = "same_node"
    controller_allocation_id: uuid.UUID | None = None
    worker_allocation_ids: list[uuid.UUID] = Field(default_factory=list)
    gpu_model: str | None = Field(default=None, description="launch: the GPU model of the new allocation")
    gpu_count: int | None = Field(default=None, ge=1, le=64, description="launch: its GPU count (default 1)")
    launch_allocation_id: uuid.UUID | None = Field(default=None, description="launch: the allocation's id")


class LaunchRequest(Payload):
    """What allocations needs to create a launchable instance's allocation (consumed from instance.created):
    the app's image pinned by digest (checked against allocations' projection of the catalog's artifacts),
    the capacity and the workload to start."""

    allocation_id: uuid.UUID
    owner_user_id: uuid.UUID | None = None
    gpu_model: str
    gpu_count: int = Field(default=1, ge=1, le=64)
    app_slug: str
    app_version: str
    image: str
    digest: Digest
    workload: dict[str, Any] = Field(description="a WorkloadSpec (gpuaas.contracts.events.allocations)")


class InstanceHealth(Payload):
    status: Literal["unknown", "healthy", "degraded", "unhealthy"] = "unknown"
    message: str = ""
    checked_at: Timestamp | None = None


class DecommissionReport(Payload):
    """Evidence of teardown. `forced` marks a decommission completed without full verification."""

    forced: bool = False
    verified_member_ids: list[uuid.UUID] = Field(default_factory=list)
    unverified_member_ids: list[uuid.UUID] = Field(default_factory=list)
    evidence: list[str] = Field(default_factory=list)
    reason: str = ""


class InstanceState(Payload):
    aggregate_field = "instance_id"

    instance_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    name: str = ""
    app_slug: str
    app_version: str
    manifest_id: uuid.UUID
    artifact_digest: Digest = Field(description="the digest this instance runs (catalog's retire gate)")
    status: InstanceStatus
    status_changed_at: Timestamp
    placement_intent: PlacementIntent = Field(default_factory=PlacementIntent)
    config: dict[str, Any] = Field(default_factory=dict, description="Deploy inputs (per the manifest's schema)")
    runtime_detail: dict[str, Any] = Field(default_factory=dict, description="adapter-owned, reported by it")
    health: InstanceHealth = Field(default_factory=InstanceHealth)
    failure_reason: str | None = None
    decommission: DecommissionReport | None = None
    version: int = Field(ge=1)
    desired_manifest_id: uuid.UUID | None = Field(
        default=None, description="manifest an upgrade/rollback asked for; None when none is in flight"
    )
    desired_app_version: str | None = None
    previous_manifest_id: uuid.UUID | None = Field(default=None, description="what a rollback returns to")
    controller_service_account_id: uuid.UUID | None = Field(
        default=None, description="the service account bound as this app's controller in the project"
    )
    launch: LaunchRequest | None = Field(default=None, description="launchable apps: the allocation to create")


class MemberState(Payload):
    """A realised member of an instance, bound to one allocation. Failed members are kept as
    tombstones (`tombstoned=True`) so what happened stays auditable."""

    aggregate_field = "member_id"

    member_id: uuid.UUID
    instance_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    component_key: str = Field(description="adapter-owned role, e.g. 'controller' or 'worker'")
    allocation_id: uuid.UUID
    status: MemberStatus
    status_changed_at: Timestamp
    last_operation_id: uuid.UUID | None = None
    detail: dict[str, Any] = Field(default_factory=dict, description="adapter-owned")
    tombstoned: bool = False
    tombstone_reason: str | None = None
    version: int = Field(ge=1)


class MemberOperationState(Payload):
    """A member-level operation a controller claims with a lease and reports on."""

    aggregate_field = "operation_id"

    operation_id: uuid.UUID
    instance_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    kind: OperationKind
    status: OperationStatus
    member_id: uuid.UUID | None = Field(default=None, description="target member (None for add)")
    component_key: str | None = None
    allocation_id: uuid.UUID | None = Field(default=None, description="target allocation (add/replace)")
    params: dict[str, Any] = Field(default_factory=dict)
    claimed_by: str | None = Field(default=None, description="service account id holding the lease")
    lease_expires_at: Timestamp | None = None
    attempt: int = Field(default=0, ge=0, description="number of claims so far")
    progress_message: str = ""
    progress_percent: int | None = Field(default=None, ge=0, le=100)
    error: str | None = None
    forced: bool = Field(default=False, description="an operator forced the outcome (e.g. force-fail)")
    version: int = Field(ge=1)
    result: dict[str, Any] = Field(
        default_factory=dict, description="what the controller reported on completion (e.g. teardown evidence)"
    )
    result_member_id: uuid.UUID | None = Field(
        default=None, description="member created by the operation (add, replace, recover)"
    )
    lease_s: int | None = Field(
        default=None, description="the lease length the current claim asked for (heartbeats keep it)"
    )
    deferred_until: Timestamp | None = Field(
        default=None,
        description="its controller deferred it: not offered again before this, or before the instance changes",
    )


class AccessGrantState(Payload):
    """The public half of an instance's access credential, to install on its allocations.

    The private key stays in custody; only the controller of the instance can fetch it.
    """

    aggregate_field = "access_grant_id"

    access_grant_id: uuid.UUID
    instance_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    allocation_ids: list[uuid.UUID] = Field(description="allocations the key must be installed on")
    public_key: str = Field(description="OpenSSH public key line")
    fingerprint: str
    purpose: Literal["controller"] = "controller"
    status: Literal["requested", "revoked"] = "requested"
    rotated_from: uuid.UUID | None = Field(default=None, description="grant this one replaces")
    version: int = Field(ge=1)


class ReleaseClearance(Payload):
    """App-runtime's answer to an allocation release request: nothing of ours runs there now."""

    aggregate_field = "allocation_id"

    allocation_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    stopped_member_ids: list[uuid.UUID] = Field(default_factory=list)
    instance_ids: list[uuid.UUID] = Field(default_factory=list)
    forced: bool = Field(default=False, description="members could not be stopped cleanly")
    cleared_at: Timestamp


class InstanceCreated(Event):
    """An instance was requested (Deploy)."""

    type: Literal["instance.created"] = "instance.created"
    data: InstanceState


class InstanceUpdated(Event):
    """Same status; health, runtime detail, config, desired version or the running version changed."""

    type: Literal["instance.updated"] = "instance.updated"
    data: InstanceState


class InstanceStarting(Event):
    """Members are being brought up."""

    type: Literal["instance.starting"] = "instance.starting"
    data: InstanceState


class InstanceRunning(Event):
    """The instance is up and healthy (also after recovering from `degraded`)."""

    type: Literal["instance.running"] = "instance.running"
    data: InstanceState


class InstanceDegraded(Event):
    """Running with reduced health; see `health`."""

    type: Literal["instance.degraded"] = "instance.degraded"
    data: InstanceState


class InstanceStopping(Event):
    """Stop requested (by a user, or because an allocation of it is being released)."""

    type: Literal["instance.stopping"] = "instance.stopping"
    data: InstanceState


class InstanceStopped(Event):
    """Stopped; it may be started again and still uses its artifact digest."""

    type: Literal["instance.stopped"] = "instance.stopped"
    data: InstanceState


class InstanceDecommissioning(Event):
    """Teardown of every member started."""

    type: Literal["instance.decommissioning"] = "instance.decommissioning"
    data: InstanceState


class InstanceDecommissioned(Event):
    """Teardown verified for every member (or forced: see `decommission.forced`). Final."""

    type: Literal["instance.decommissioned"] = "instance.decommissioned"
    data: InstanceState


class InstanceDecommissionFailed(Event):
    """Teardown could not be verified; `decommission` holds the evidence."""

    type: Literal["instance.decommission_failed"] = "instance.decommission_failed"
    data: InstanceState


class InstanceFailed(Event):
    """Start or run failed (`failure_reason`)."""

    type: Literal["instance.failed"] = "instance.failed"
    data: InstanceState


class MemberAdded(Event):
    """A member was bound to an allocation."""

    type: Literal["member.added"] = "member.added"
    data: MemberState


class MemberUpdated(Event):
    """Member status or detail changed."""

    type: Literal["member.updated"] = "member.updated"
    data: MemberState


class MemberTombstoned(Event):
    """The member is gone (removed or failed); kept as an auditable tombstone."""

    type: Literal["member.tombstoned"] = "member.tombstoned"
    data: MemberState


class MemberOperationCreated(Event):
    """An operation is pending for the instance's controller."""

    type: Literal["member_operation.created"] = "member_operation.created"
    data: MemberOperationState


class MemberOperationClaimed(Event):
    """A controller claimed the operation with a lease (`lease_expires_at`)."""

    type: Literal["member_operation.claimed"] = "member_operation.claimed"
    data: MemberOperationState


class MemberOperationProgressed(Event):
    """The controller reported progress (`in_progress`; lease extended)."""

    type: Literal["member_operation.progressed"] = "member_operation.progressed"
    data: MemberOperationState


class MemberOperationRequeued(Event):
    """Back to `pending`: the lease expired or an operator retried it."""

    type: Literal["member_operation.requeued"] = "member_operation.requeued"
    data: MemberOperationState


class MemberOperationSucceeded(Event):
    type: Literal["member_operation.succeeded"] = "member_operation.succeeded"
    data: MemberOperationState


class MemberOperationFailed(Event):
    """Failed (`error`); `forced` when an operator force-failed a stuck operation."""

    type: Literal["member_operation.failed"] = "member_operation.failed"
    data: MemberOperationState


class MemberOperationCancelled(Event):
    type: Literal["member_operation.cancelled"] = "member_operation.cancelled"
    data: MemberOperationState


class AccessGrantRequested(Event):
    """Install this public key on these allocations (new grant or rotation)."""

    type: Literal["access_grant.requested"] = "access_grant.requested"
    data: AccessGrantState


class AccessGrantUpdated(Event):
    """The set of allocations changed (member added or removed): sync the key to `allocation_ids`."""

    type: Literal["access_grant.updated"] = "access_grant.updated"
    data: AccessGrantState


class AccessGrantRevoked(Event):
    """Remove this public key from every allocation."""

    type: Literal["access_grant.revoked"] = "access_grant.revoked"
    data: AccessGrantState


class ReleaseClearanceGranted(Event):
    """Every member on the allocation is stopped (or there were none): allocations may release it."""

    type: Literal["release_clearance.granted"] = "release_clearance.granted"
    data: ReleaseClearance


EVENTS: tuple[type[Event], ...] = (
    InstanceCreated,
    InstanceUpdated,
    InstanceStarting,
    InstanceRunning,
    InstanceDegraded,
    InstanceStopping,
    InstanceStopped,
    InstanceDecommissioning,
    InstanceDecommissioned,
    InstanceDecommissionFailed,
    InstanceFailed,
    MemberAdded,
    MemberUpdated,
    MemberTombstoned,
    MemberOperationCreated,
    MemberOperationClaimed,
    MemberOperationProgressed,
    MemberOperationRequeued,
    MemberOperationSucceeded,
    MemberOperationFailed,
    MemberOperationCancelled,
    AccessGrantRequested,
    AccessGrantUpdated,
    AccessGrantRevoked,
    ReleaseClearanceGranted,
)
