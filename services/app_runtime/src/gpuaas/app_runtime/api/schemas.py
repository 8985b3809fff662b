"""Request and response bodies of app-runtime's HTTP API (their names are the OpenAPI components).

Responses are validated from the service's views by attribute (FastAPI's response models), so a view and
its schema name the same fields; the schema decides what is answered (e.g. never a lease token or a
sealed key in a listing).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field

from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events.app_runtime import (
    DecommissionReport,
    InstanceHealth,
    MemberStatus,
    OperationKind,
    OperationStatus,
    PlacementIntent,
)
from gpuaas.contracts.scalars import Integer, Name, Text

SLUG = r"^[a-z0-9][a-z0-9-]*$"
PRECONDITION: dict[int | str, dict[str, Any]] = {
    412: {"description": "`version_mismatch`: If-Match names a version the resource has moved on from"}
}
JsonObject = dict[str, Any]
T = TypeVar("T")


class Instance(BaseModel):
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
    config: JsonObject
    runtime_detail: JsonObject
    health: InstanceHealth
    failure_reason: str | None
    decommission: DecommissionReport | None
    desired_manifest_id: uuid.UUID | None
    desired_app_version: str | None
    previous_manifest_id: uuid.UUID | None
    version: int
    created_at: datetime


class Member(BaseModel):
    member_id: uuid.UUID
    instance_id: uuid.UUID
    component_key: str
    allocation_id: uuid.UUID
    status: MemberStatus
    status_changed_at: datetime
    last_operation_id: uuid.UUID | None
    detail: JsonObject
    tombstoned: bool
    tombstone_reason: str | None
    version: int


class Operation(BaseModel):
    operation_id: uuid.UUID
    instance_id: uuid.UUID
    project_id: uuid.UUID
    app_slug: str
    kind: OperationKind
    status: OperationStatus
    member_id: uuid.UUID | None
    result_member_id: uuid.UUID | None
    component_key: str | None
    allocation_id: uuid.UUID | None
    params: JsonObject
    claimed_by: str | None
    lease_expires_at: datetime | None
    attempt: int
    progress_message: str
    progress_percent: int | None
    error: str | None
    forced: bool
    result: JsonObject
    lease_s: int | None = Field(default=None, description="the lease length of the current claim")
    deferred_until: datetime | None = Field(
        default=None, description="deferred by its controller: offered again then, or once the instance changes"
    )
    version: int
    created_at: datetime
    updated_at: datetime


class TimelineEntry(BaseModel):
    seq: int
    instance_id: uuid.UUID
    kind: str
    message: str
    data: JsonObject
    actor: str | None
    occurred_at: datetime


class Page(BaseModel, Generic[T]):
    items: list[T]


class CredentialPublic(BaseModel):
    """The public half only: the private key is delivered to the instance's controller and nowhere else."""

    credential_id: uuid.UUID
    instance_id: uuid.UUID
    public_key: str
    fingerprint: str
    custody: str
    status: str
    allocation_ids: list[uuid.UUID]
    rotated_from: uuid.UUID | None
    created_at: datetime


class CredentialSecret(CredentialPublic):
    private_key: str = Field(description="OpenSSH private key; keep it in memory, never log it")


class DeployRequest(BaseModel):
    name: Name = Field(min_length=1, max_length=100)
    app_slug: str = Field(pattern=SLUG, max_length=100)
    app_version: str | None = Field(default=None, max_length=100, description="default: the latest active version")
    config: JsonObject = Field(default_factory=dict)
    placement_intent: PlacementIntent


class OperationRequest(BaseModel):
    kind: OperationKind
    member_id: uuid.UUID | None = None
    allocation_id: uuid.UUID | None = None
    component_key: str | None = Field(default=None, max_length=100)
    params: JsonObject = Field(default_factory=dict)


class Reason(BaseModel):
    reason: Text = Field("", max_length=2000)


class VersionChange(BaseModel):
    app_version: str = Field(min_length=1, max_length=100)


class ControllerBinding(BaseModel):
    service_account_id: uuid.UUID


class ControllerBindingOut(BaseModel):
    binding_id: uuid.UUID
    project_id: uuid.UUID
    app_slug: str
    service_account_id: uuid.UUID


class ClaimRequest(BaseModel):
    app_slug: str = Field(pattern=SLUG, max_length=100)
    operation_id: uuid.UUID | None = Field(default=None, description="a given operation; default: the oldest claimable")
    lease_s: Integer | None = Field(default=None, ge=5, le=3600)
    holder: Name | None = Field(default=None, max_length=200, description="which controller replica (for the timeline)")


class Claim(BaseModel):
    operation: Operation
    lease_token: uuid.UUID
    lease_expires_at: datetime


class Heartbeat(BaseModel):
    lease_token: uuid.UUID
    lease_s: Integer | None = Field(default=None, ge=5, le=3600)
    message: Text | None = Field(default=None, max_length=2000)
    percent: Integer | None = Field(default=None, ge=0, le=100)


class Completion(BaseModel):
    lease_token: uuid.UUID
    result: JsonObject = Field(default_factory=dict, description="e.g. {teardown_verified: true, evidence: '...'}")
    member_detail: JsonObject | None = None


class Failure(BaseModel):
    lease_token: uuid.UUID
    error: Text = Field(min_length=1, max_length=4000)


class Deferral(BaseModel):
    lease_token: uuid.UUID
    reason: Text = Field(default="", max_length=2000)
    delay_s: Integer | None = Field(
        default=None,
        ge=0,
        le=3600,
        description="offer it again after this at the latest (default: the service's maximum deferral); "
        "any change of the instance (an operation finished, a member reported) offers it again sooner",
    )


class InstanceReport(BaseModel):
    status: Literal["running", "degraded", "failed"] | None = None
    health: InstanceHealth | None = None
    runtime_detail: JsonObject | None = None
    app_version: str | None = Field(default=None, description="the version now rolled out (after an upgrade)")


class MemberReport(BaseModel):
    status: Literal["active", "failed"] | None = None
    detail: JsonObject | None = None


class ControllerEvent(BaseModel):
    kind: str = Field(min_length=1, max_length=100, pattern=r"^[a-z0-9_.-]+$")
    message: Text = Field("", max_length=4000)
    data: JsonObject = Field(default_factory=dict)


class ControllerState(BaseModel):
    instance_id: uuid.UUID
    state: dict[str, Any]
    version: int = Field(description="0 while nothing is stored")
    updated_at: datetime | None


class ControllerStateWrite(BaseModel):
    state: dict[str, Any]
    expected_version: int = Field(ge=0, description="the version read (0: nothing stored yet)")
