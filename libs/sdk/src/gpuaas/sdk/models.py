"""Typed views of the public app-runtime API (what the gateway answers under `/api/app-runtime/`).

Unknown fields are ignored, so a newer platform never breaks an older client.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events.app_runtime import (
    DecommissionReport,
    InstanceHealth,
    MemberStatus,
    OperationKind,
    OperationStatus,
    PlacementIntent,
)

__all__ = [
    "Claim",
    "Credential",
    "CredentialSecret",
    "DecommissionReport",
    "Instance",
    "InstanceHealth",
    "InstanceStatus",
    "Member",
    "MemberStatus",
    "Operation",
    "OperationKind",
    "OperationStatus",
    "PlacementIntent",
    "TimelineEntry",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Instance(_Model):
    instance_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    name: str
    app_slug: str
    app_version: str
    manifest_id: uuid.UUID
    artifact_digest: str
    status: InstanceStatus
    status_changed_at: datetime
    placement_intent: PlacementIntent
    config: dict[str, Any] = Field(default_factory=dict)
    runtime_detail: dict[str, Any] = Field(default_factory=dict)
    health: InstanceHealth = Field(default_factory=InstanceHealth)
    failure_reason: str | None = None
    decommission: DecommissionReport | None = None
    desired_manifest_id: uuid.UUID | None = None
    desired_app_version: str | None = None
    previous_manifest_id: uuid.UUID | None = None
    version: int


class Member(_Model):
    member_id: uuid.UUID
    instance_id: uuid.UUID
    component_key: str
    allocation_id: uuid.UUID
    status: MemberStatus
    status_changed_at: datetime
    last_operation_id: uuid.UUID | None = None
    detail: dict[str, Any] = Field(default_factory=dict)
    tombstoned: bool = False
    tombstone_reason: str | None = None
    version: int


class Operation(_Model):
    operation_id: uuid.UUID
    instance_id: uuid.UUID
    project_id: uuid.UUID
    app_slug: str
    kind: OperationKind
    status: OperationStatus
    member_id: uuid.UUID | None = None
    result_member_id: uuid.UUID | None = None
    component_key: str | None = None
    allocation_id: uuid.UUID | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    claimed_by: str | None = None
    lease_expires_at: datetime | None = None
    attempt: int = 0
    progress_message: str = ""
    progress_percent: int | None = None
    error: str | None = None
    forced: bool = False
    result: dict[str, Any] = Field(default_factory=dict)
    version: int

    @property
    def target_member_id(self) -> uuid.UUID | None:
        """The member this operation brings up or acts on."""
        return self.result_member_id or self.member_id


class Claim(_Model):
    operation: Operation
    lease_token: uuid.UUID
    lease_expires_at: datetime


class Credential(_Model):
    credential_id: uuid.UUID
    instance_id: uuid.UUID
    public_key: str
    fingerprint: str
    custody: str
    status: str
    allocation_ids: list[uuid.UUID] = Field(default_factory=list)
    rotated_from: uuid.UUID | None = None


class CredentialSecret(Credential):
    private_key: str = Field(repr=False)


class TimelineEntry(_Model):
    seq: int
    instance_id: uuid.UUID
    kind: str
    message: str
    data: dict[str, Any] = Field(default_factory=dict)
    actor: str | None = None
    occurred_at: datetime
