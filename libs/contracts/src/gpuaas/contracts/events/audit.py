"""`gpuaas.audit.v1`: one record per mutation in any service; identity stores and serves them."""

# Each event class narrows the envelope's `type: str` to its own Literal (the discriminator of its topic's
# union): pydantic's way, which the checker calls an incompatible override of a mutable field.
# pyright: reportIncompatibleVariableOverride=false
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gpuaas.contracts.envelope import Event, Payload


class AuditRecord(Payload):
    """One mutation: keyed by the resource it changed, so a resource's history stays ordered."""

    aggregate_field = "resource_id"

    service: str
    action: str = Field(description="permission-style action, e.g. 'allocations.create'")
    resource_type: str
    resource_id: str
    outcome: Literal["succeeded", "denied", "failed"] = "succeeded"
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    reason: str | None = None


class AuditRecorded(Event):
    type: Literal["audit.recorded"] = "audit.recorded"
    data: AuditRecord


EVENTS: tuple[type[Event], ...] = (AuditRecorded,)
