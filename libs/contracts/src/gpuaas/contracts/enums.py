"""Enums shared by several services. Stored and sent as text (StrEnum)."""

from enum import StrEnum


class Role(StrEnum):
    platform_admin = "platform_admin"
    tenant_admin = "tenant_admin"
    project_admin = "project_admin"
    project_member = "project_member"
    viewer = "viewer"


class MembershipScope(StrEnum):
    platform = "platform"
    tenant = "tenant"
    project = "project"


class CapacityShape(StrEnum):
    """How an allocation holds a host: the whole host, or some of its GPUs."""

    baremetal = "baremetal"
    gpu_slice = "gpu_slice"


class AllocationStatus(StrEnum):
    """Allocation lifecycle (ARCHITECTURE §6).

    requested → provisioning → active ⇄ restarting | resizing → releasing → released;
    `failed` when provisioning fails; `release_failed` when release fails (billing has already
    stopped at the release request; the release can be retried). `queued` (issue 29): the request
    waits for capacity (holding none) until admission places it (→ provisioning), it is cancelled
    (→ released) or its `max_wait` passes (→ failed).
    """

    requested = "requested"
    provisioning = "provisioning"
    active = "active"
    restarting = "restarting"
    resizing = "resizing"
    releasing = "releasing"
    released = "released"
    failed = "failed"
    release_failed = "release_failed"
    queued = "queued"


class PendingReason(StrEnum):
    """Why a `queued` allocation is not running yet."""

    no_capacity = "no_capacity"  # no ready host has the shape free now
    over_limit = "over_limit"  # its project is at its limit (queue limit or GPU quota)
    over_tenant_limit = "over_tenant_limit"  # its tenant is at its limit in the pool
    waiting_for_preemption = "waiting_for_preemption"  # borrowed GPUs are being reclaimed for it


class InstanceStatus(StrEnum):
    """App instance lifecycle (ARCHITECTURE §8).

    created → starting → running ⇄ degraded → stopping → stopped; decommissioning →
    decommissioned (only after verified teardown of every member) or decommission_failed;
    `failed` from start or run.
    """

    created = "created"
    starting = "starting"
    running = "running"
    degraded = "degraded"
    stopping = "stopping"
    stopped = "stopped"
    decommissioning = "decommissioning"
    decommissioned = "decommissioned"
    decommission_failed = "decommission_failed"
    failed = "failed"


class AppUsageUnit(StrEnum):
    """App-level usage dimensions (metered by metering, priced by billing); never GPU time."""

    tokens = "tokens"
    requests = "requests"
    model_seconds = "model_seconds"
    app_hours = "app_hours"  # a launchable app's running time, metered by the platform itself (issue 21)
