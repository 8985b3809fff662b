"""What the catalog's use cases return (and its routers answer): typed views of artifacts, their
history, manifests and compatibility verdicts. Class and field names are the API's response schemas."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from gpuaas.contracts.envelope import Payload
from gpuaas.contracts.events.catalog import ArtifactKind, ArtifactLifecycle


class Check(BaseModel):
    name: str
    passed: bool
    recorded_at: datetime
    detail: str


class Artifact(BaseModel):
    artifact_id: uuid.UUID
    kind: ArtifactKind
    ref: str
    registry: str
    repository: str
    digest: str
    media_type: str | None
    artifact_type: str | None
    size_bytes: int | None
    state: ArtifactLifecycle
    canary_tenants: list[uuid.UUID]
    checks: list[Check]
    signature_verified: bool
    signature_detail: str | None
    version: int
    created_at: datetime
    updated_at: datetime


class TransitionRecord(BaseModel):
    transition_id: uuid.UUID
    from_state: str | None
    to_state: str
    actor_kind: str
    actor_id: str
    reason: str
    detail: dict[str, Any]
    occurred_at: datetime


class Verification(BaseModel):
    passed: bool
    code: str | None = None
    detail: str
    artifact: Artifact


class Manifest(BaseModel):
    manifest_id: uuid.UUID
    slug: str
    display_name: str
    description: str
    version: str = Field(description="the app's own version")
    runtime_version: str | None = Field(description="what it installs (e.g. Slurm 22.05), shown separately")
    artifact_kind: str
    artifact_ref: str
    artifact_id: uuid.UUID | None
    artifact_state: str
    canary: bool = False
    compatibility: dict[str, Any]
    runtime_profile: dict[str, Any] | None
    inputs: dict[str, Any]
    roles: list[dict[str, Any]]
    active: bool
    deprecated: bool
    revision: int
    created_at: datetime
    updated_at: datetime


class Reason_(BaseModel):  # the name is the OpenAPI schema's (kept as it was)
    code: str
    message: str


class CompatibilityVerdict(BaseModel):
    manifest_id: uuid.UUID
    slug: str
    version: str
    runtime_version: str | None
    compatible: bool = Field(description="the allocation offers what the app needs")
    deployable: bool = Field(description="compatible, and the version is offered to the tenant")
    reasons: list[Reason_]


@dataclass(frozen=True)
class SnapshotPage:
    """A page of full states (the events' payloads); `next` is the key to page on, None at the end."""

    items: list[Payload]  # ArtifactState, AppManifestState or EntitlementState
    next: uuid.UUID | None
