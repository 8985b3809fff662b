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
    stopped at the release request; the release can be retried).
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
