"""`gpuaas.usage.v1`: meters, GPU usage records and app usage records (owner: metering).

A meter opens when an allocation is activated, changes when it is resized and closes at the
release request, so billing stops even if the release fails. Usage records are facts, one per
closed window; billing charges each record exactly once, keyed by its id. That id is derived
deterministically (`usage_record_id`), so a window recomputed after a crash or a replay gets
the same id and is never charged twice. App usage is a separate dimension: it never carries
GPU time.

Keys: meter and usage-record events are keyed by allocation id (one allocation's usage stays
in order); app usage by instance id. Not compacted: billing consumes every record.
"""

# Each event class narrows the envelope's `type: str` to its own Literal (the discriminator of its topic's
# union): pydantic's way, which the checker calls an incompatible override of a mutable field.
# pyright: reportIncompatibleVariableOverride=false
from __future__ import annotations

import uuid
from datetime import datetime
from typing import Literal, Self

from pydantic import Field, model_validator

from gpuaas.contracts.enums import AppUsageUnit, CapacityShape
from gpuaas.contracts.envelope import Event, Payload, stable_id
from gpuaas.contracts.scalars import Quantity, Timestamp


def usage_record_id(allocation_id: uuid.UUID, window_start: datetime) -> uuid.UUID:
    """The id of an allocation's usage window: windows of one allocation never share a start."""
    return stable_id("usage_record", allocation_id, window_start)


def app_usage_record_id(instance_id: uuid.UUID, idempotency_key: str) -> uuid.UUID:
    """The id of a posted app usage event: a re-post with the same key is the same record."""
    return stable_id("app_usage_record", instance_id, idempotency_key)


class MeterState(Payload):
    """The open (or closed) usage interval of one allocation."""

    aggregate_field = "allocation_id"

    allocation_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    host_id: uuid.UUID | None = None
    shape: CapacityShape
    gpu_model: str
    gpu_count: int = Field(ge=1, description="GPUs billed from `changed_at` (or `opened_at`)")
    status: Literal["open", "closed"]
    opened_at: Timestamp
    changed_at: Timestamp | None = Field(default=None, description="last resize")
    closed_at: Timestamp | None = Field(default=None, description="the release request time")
    version: int = Field(ge=1)
    billed_until: Timestamp | None = Field(
        default=None, description="end of the last usage window recorded (GPU time before it is in usage records)"
    )
    close_reason: str | None = Field(default=None, description="why the meter closed, e.g. 'release_requested'")
    suspended_at: Timestamp | None = Field(
        default=None, description="billing paused here (host heartbeat lost beyond the grace period)"
    )
    suspend_reason: str | None = Field(default=None, description="why billing is paused, human-readable")
    resumed_at: Timestamp | None = Field(default=None, description="last time billing resumed after a suspension")


class UsageRecord(Payload):
    """GPU time of one allocation over `[window_start, window_end)` at a constant gpu count."""

    aggregate_field = "allocation_id"

    usage_record_id: uuid.UUID = Field(description="usage_record_id(allocation_id, window_start)")
    allocation_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    host_id: uuid.UUID | None = None
    shape: CapacityShape
    gpu_model: str
    gpu_count: int = Field(ge=1)
    window_start: Timestamp
    window_end: Timestamp
    gpu_seconds: Quantity = Field(description="gpu_count * window seconds")
    final: bool = Field(default=False, description="the last record of the meter (closed at release request)")
    instance_id: uuid.UUID | None = Field(
        default=None,
        description="the app instance whose members ran on the allocation during the window (None: no app, or several)",
    )

    @model_validator(mode="after")
    def _window_is_ordered(self) -> Self:
        if self.window_end < self.window_start:
            raise ValueError("window_end is before window_start")
        return self


class AppUsageRecord(Payload):
    """App-level usage posted by a controller or app with an idempotency key."""

    aggregate_field = "instance_id"

    app_usage_record_id: uuid.UUID = Field(description="app_usage_record_id(instance_id, idempotency_key)")
    instance_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    app_slug: str
    member_id: uuid.UUID | None = None
    unit: AppUsageUnit
    quantity: Quantity
    idempotency_key: str = Field(min_length=1, max_length=200)
    occurred_at: Timestamp
    reported_by: str | None = Field(default=None, description="actor id of the reporter")


class MeterOpened(Event):
    """The allocation was activated: GPU time counts from `opened_at`."""

    type: Literal["meter.opened"] = "meter.opened"
    data: MeterState


class MeterChanged(Event):
    """The allocation was resized: the new `gpu_count` counts from `changed_at`."""

    type: Literal["meter.changed"] = "meter.changed"
    data: MeterState


class MeterClosed(Event):
    """Release was requested: GPU time stops at `closed_at`, whatever happens to the release."""

    type: Literal["meter.closed"] = "meter.closed"
    data: MeterState


class MeterSuspended(Event):
    """The allocation's host stopped heartbeating: GPU time stops at `suspended_at` (last heartbeat +
    grace) until the host is back; `suspend_reason` says why."""

    type: Literal["meter.suspended"] = "meter.suspended"
    data: MeterState


class MeterResumed(Event):
    """The host is heartbeating again: GPU time counts again from `resumed_at`."""

    type: Literal["meter.resumed"] = "meter.resumed"
    data: MeterState


class UsageRecorded(Event):
    """A closed usage window, to be charged once by billing."""

    type: Literal["usage.recorded"] = "usage.recorded"
    data: UsageRecord


class AppUsageRecorded(Event):
    """App-level usage (tokens, requests, model-seconds), to be charged once by billing."""

    type: Literal["app_usage.recorded"] = "app_usage.recorded"
    data: AppUsageRecord


EVENTS: tuple[type[Event], ...] = (
    MeterOpened,
    MeterChanged,
    MeterClosed,
    UsageRecorded,
    AppUsageRecorded,
    MeterSuspended,
    MeterResumed,
)
