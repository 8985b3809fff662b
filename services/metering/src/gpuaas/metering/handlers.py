"""Metering's consumers: allocation lifecycle and host heartbeats (meters), app instances and their members
(attribution)."""

from __future__ import annotations

from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.contracts.events import app_runtime as app_runtime_events
from gpuaas.kit.subscriptions import Subscriptions
from gpuaas.metering import service

subscriptions = Subscriptions()

subscriptions.on(
    allocation_events.AllocationActivated,
    allocation_events.AllocationRestarting,
    allocation_events.AllocationRestarted,
    allocation_events.AllocationRestartFailed,
    allocation_events.AllocationResizing,
    allocation_events.AllocationResized,
    allocation_events.AllocationResizeFailed,
    allocation_events.AllocationReleaseRequested,
    allocation_events.AllocationReleased,
    allocation_events.AllocationReleaseFailed,
    allocation_events.AllocationFailed,
)(service.apply_allocation)
subscriptions.on(
    allocation_events.HostEnrolled,
    allocation_events.HostUpdated,
    allocation_events.HostCordoned,
    allocation_events.HostHeartbeatLost,
)(service.apply_host)
subscriptions.on(
    app_runtime_events.InstanceCreated,
    app_runtime_events.InstanceStarting,
    app_runtime_events.InstanceRunning,
    app_runtime_events.InstanceDegraded,
    app_runtime_events.InstanceStopping,
    app_runtime_events.InstanceStopped,
    app_runtime_events.InstanceDecommissioning,
    app_runtime_events.InstanceDecommissioned,
    app_runtime_events.InstanceDecommissionFailed,
    app_runtime_events.InstanceFailed,
)(service.apply_instance)
subscriptions.on(
    app_runtime_events.MemberAdded,
    app_runtime_events.MemberUpdated,
    app_runtime_events.MemberTombstoned,
)(service.apply_member)
