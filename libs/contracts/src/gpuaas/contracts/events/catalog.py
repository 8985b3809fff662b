"""`gpuaas.catalog.v1`: app manifests, artifacts and entitlements (owner: catalog).

Full state per event, keyed by entity id (compacted): app-runtime keeps a projection of
manifests, artifacts and entitlements to validate a Deploy without calling catalog.

Trust rules travel in the types: artifacts are always referenced by digest (`PinnedRef`,
`Digest`), never by a movable tag. An artifact transition carries its full state plus the
`from_state`/`reason` of the move, so the promotion history is auditable from the topic.
"""

# Each event class narrows the envelope's `type: str` to its own Literal (the discriminator of its topic's
# union): pydantic's way, which the checker calls an incompatible override of a mutable field.
# pyright: reportIncompatibleVariableOverride=false
from __future__ import annotations

import uuid
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field

from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.envelope import Event, Payload
from gpuaas.contracts.scalars import Digest, PinnedRef, Timestamp


class AppArtifactKind(StrEnum):
    """What an app manifest deploys: an OCI image, a launchable OCI workload, a controller
    (clustered app driven through the runtime API), a non-OCI blob, or a runtime: the OCI image an
    allocation's container is created from (chosen at allocation create, not deployed as an app)."""

    oci = "oci"
    launchable = "launchable"
    controller = "controller"
    blob = "blob"
    runtime = "runtime"


class ArtifactKind(StrEnum):
    oci = "oci"
    blob = "blob"


class ArtifactLifecycle(StrEnum):
    """draft → staged → canary → active → deprecated → retired; canary → staged is a rollback."""

    draft = "draft"
    staged = "staged"
    canary = "canary"
    active = "active"
    deprecated = "deprecated"
    retired = "retired"


class Compatibility(Payload):
    """What an allocation must offer for the app to be deployed into it."""

    requires_capacity_shape: list[CapacityShape] = Field(
        default_factory=lambda: [CapacityShape.baremetal, CapacityShape.gpu_slice],
        description="allocation shapes the app runs on",
    )
    min_gpu_count: int = Field(default=1, ge=0)
    requires_exclusive_node: bool = False
    multi_allocation: bool = Field(default=False, description="members may span several allocations")


class AppRole(Payload):
    """A member role the app's adapter owns (e.g. Slurm controller/worker); opaque to the platform."""

    key: str
    display_name: str = ""
    description: str = ""
    after: list[str] = Field(
        default_factory=list,
        description=(
            "roles this one comes up after: the runtime hands out this role's add, replace and recover only "
            "while no member of these roles is still coming up, and the removal (remove, drain) of a member "
            "of these roles only once no member of this role is still being removed or drained"
        ),
    )


class AppManifestState(Payload):
    """One version of an app. `version` is the app's own; `runtime_version` the daemon it installs.

    Unlike other entities, the change counter is `revision`, since `version` is the app's version.
    """

    aggregate_field = "manifest_id"

    manifest_id: uuid.UUID
    slug: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    display_name: str
    description: str = ""
    version: str = Field(description="the app's own version")
    runtime_version: str | None = Field(default=None, description="e.g. 'Slurm 22.05'; shown separately")
    artifact_kind: AppArtifactKind
    artifact_ref: PinnedRef
    artifact_id: uuid.UUID | None = None
    compatibility: Compatibility = Field(default_factory=Compatibility)
    runtime_profile: dict[str, Any] | None = Field(
        default=None, description="launchable OCI workload profile (validated by catalog)"
    )
    inputs: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON Schema of what Deploy collects",
    )
    roles: list[AppRole] = Field(default_factory=list)
    active: bool = Field(description="offered for new deployments")
    deprecated: bool = Field(default=False, description="existing instances continue; no new ones")
    revision: int = Field(ge=1, description="change counter of this manifest (`version` is the app's)")


class ArtifactCheck(Payload):
    """A recorded gate result (staging needs lint and smoke)."""

    name: Literal["lint", "smoke", "signature", "content"]
    passed: bool
    recorded_at: Timestamp
    detail: str = ""


class ArtifactState(Payload):
    aggregate_field = "artifact_id"

    artifact_id: uuid.UUID
    kind: ArtifactKind
    ref: PinnedRef
    digest: Digest
    media_type: str | None = None
    size_bytes: int | None = Field(default=None, ge=0)
    state: ArtifactLifecycle
    canary_tenants: list[uuid.UUID] = Field(default_factory=list, description="tenants that get a canary")
    checks: list[ArtifactCheck] = Field(default_factory=list)
    signature_verified: bool = False
    version: int = Field(ge=1)


class ArtifactTransition(ArtifactState):
    """Artifact state after a promotion/rollback/retirement, with where it came from and why."""

    from_state: ArtifactLifecycle
    reason: str = ""


class EntitlementState(Payload):
    """A tenant may deploy an app (all its versions)."""

    aggregate_field = "entitlement_id"

    entitlement_id: uuid.UUID
    tenant_id: uuid.UUID
    app_slug: str
    status: Literal["granted", "revoked"] = "granted"
    granted_at: Timestamp
    revoked_at: Timestamp | None = None
    version: int = Field(ge=1)


class AppRegistered(Event):
    """A new app manifest version was registered."""

    type: Literal["app.registered"] = "app.registered"
    data: AppManifestState


class AppUpdated(Event):
    """A manifest changed (e.g. activated, artifact promoted, display fields)."""

    type: Literal["app.updated"] = "app.updated"
    data: AppManifestState


class AppDeprecated(Event):
    """The manifest may no longer be used by a new instance; existing ones continue."""

    type: Literal["app.deprecated"] = "app.deprecated"
    data: AppManifestState


class ArtifactRegistered(Event):
    """An artifact digest was recorded (state `draft`)."""

    type: Literal["artifact.registered"] = "artifact.registered"
    data: ArtifactState


class ArtifactUpdated(Event):
    """The artifact changed without moving in its lifecycle (a lint/smoke/content check was recorded)."""

    type: Literal["artifact.updated"] = "artifact.updated"
    data: ArtifactState


class ArtifactTransitioned(Event):
    """The artifact moved `from_state` → `state` (audited; `reason` given)."""

    type: Literal["artifact.transitioned"] = "artifact.transitioned"
    data: ArtifactTransition


class EntitlementGranted(Event):
    """A tenant may now deploy the app."""

    type: Literal["entitlement.granted"] = "entitlement.granted"
    data: EntitlementState


class EntitlementRevoked(Event):
    """The tenant may no longer deploy the app; existing instances are not stopped."""

    type: Literal["entitlement.revoked"] = "entitlement.revoked"
    data: EntitlementState


EVENTS: tuple[type[Event], ...] = (
    AppRegistered,
    AppUpdated,
    AppDeprecated,
    ArtifactRegistered,
    ArtifactTransitioned,
    EntitlementGranted,
    EntitlementRevoked,
    ArtifactUpdated,
)
