"""Metering's consumers: allocation lifecycle and host heartbeats (meters), app instances (attribution)."""

from __future__ import annotations

from gpuaas.contracts.events import allocations as al
from gpuaas.contracts.events import app_runtime as ar
from gpuaas.kit.subscriptions import Subscriptions
from gpuaas.metering import service

subscriptions = Subscriptions()

subscriptions.on(*service.ALLOCATION_EVENTS)(service.apply_allocation)
subscriptions.on(al.HostEnrolled, al.HostUpdated, al.HostCordoned, al.HostHeartbeatLost)(service.apply_host)
subscriptions.on(
    ar.InstanceCreated,
    ar.InstanceStarting,
    ar.InstanceRunning,
    ar.InstanceDegraded,
    ar.InstanceStopping,
    ar.InstanceStopped,
    ar.InstanceDecommissioning,
    ar.InstanceDecommissioned,
    ar.InstanceDecommissionFailed,
    ar.InstanceFailed,
)(service.apply_instance)
