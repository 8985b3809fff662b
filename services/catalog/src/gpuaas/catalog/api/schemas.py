"""Request and response models of the catalog's HTTP API.

The response models are the use cases' typed views (gpuaas.catalog.service.views), re-exported here
so that the routers and the OpenAPI document name one set of schemas."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from gpuaas.catalog import domain
from gpuaas.catalog.service.views import (
    Artifact,
    Check,
    CompatibilityVerdict,
    Manifest,
    Reason_,
    TransitionRecord,
    Verification,
)
from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events.catalog import ArtifactKind, ArtifactLifecycle
from gpuaas.contracts.scalars import Integer, Text

__all__ = [
    "Artifact",
    "ArtifactRegister",
    "Check",
    "CheckRecord",
    "CompatibilityQuery",
    "CompatibilityVerdict",
    "Entitlement",
    "EntitlementGrant",
    "Manifest",
    "Reason",
    "Reason_",
    "RequiredReason",
    "SeedRequest",
    "Transition",
    "TransitionRecord",
    "Verification",
]

SLUG = domain.SLUG_PATTERN


# ----------------------------------------------------------------------------------------- requests


class ArtifactRegister(BaseModel):
    ref: str = Field(max_length=512, description="registry/repository@sha256:<64 hex>; a tag is refused")
    kind: ArtifactKind = ArtifactKind.oci
    public_key: str | None = Field(
        None, max_length=10_000, description="PEM public key of a cosign key pair: the signature must verify"
    )


class CheckRecord(BaseModel):
    name: Literal["lint", "smoke"]
    passed: bool
    detail: Text = Field("", max_length=2000)


class Transition(BaseModel):
    to: ArtifactLifecycle
    reason: Text = Field(min_length=1, max_length=1000, description="why (kept in the audit trail)")
    canary_tenants: list[uuid.UUID] = Field(default_factory=list, max_length=1000)


class Reason(BaseModel):
    reason: Text = Field("", max_length=1000)


class RequiredReason(BaseModel):
    reason: Text = Field(min_length=1, max_length=1000)


class EntitlementGrant(BaseModel):
    tenant_id: uuid.UUID
    app_slug: str = Field(pattern=SLUG)


class CompatibilityQuery(BaseModel):
    version: str | None = Field(None, max_length=100)
    tenant_id: uuid.UUID | None = None
    capacity_shape: CapacityShape
    gpu_count: Integer = Field(ge=0, le=1024)
    exclusive_node: bool = False
    allocation_count: Integer = Field(1, ge=1, le=1024)


class SeedRequest(BaseModel):
    registry: str = Field(max_length=255, description="host:port of the OCI registry to push the seed artifacts to")
    tenant_ids: list[uuid.UUID] = Field(min_length=1, max_length=100)


# ---------------------------------------------------------------------------------------- responses


# An entitlement as served (the use cases return the contract's EntitlementState). No docstring:
# it would become the schema's description in the OpenAPI document.
class Entitlement(BaseModel):
    entitlement_id: uuid.UUID
    tenant_id: uuid.UUID
    app_slug: str
    status: str
    granted_at: datetime
    revoked_at: datetime | None
    version: int
