"""Typed views of app-runtime's rows: what use cases return and pass around instead of SQLAlchemy rows.

Each view names the columns it carries; `from_row` copies exactly those from a row, so a column added by a
later migration is ignored until a view asks for it. The API shapes its answers from these
(response models validate them by attribute).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, ClassVar, Protocol, TypeVar

from sqlalchemy import Row

from gpuaas.app_runtime.custody import KeyPair, Sealed

JsonObject = dict[str, Any]


class _Dataclass(Protocol):
    __dataclass_fields__: ClassVar[dict[str, Any]]


ViewT = TypeVar("ViewT", bound=_Dataclass)


def from_row(cls: type[ViewT], row: Row[Any]) -> ViewT:
    """The view `cls` of a row (its own columns only)."""
    mapping = row._mapping
    build: Callable[..., ViewT] = cls
    return build(**{f.name: mapping[f.name] for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class InstanceView:
    instance_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    name: str
    app_slug: str
    app_version: str
    manifest_id: uuid.UUID
    artifact_digest: str
    status: str
    status_changed_at: datetime
    placement_intent: JsonObject
    config: JsonObject
    runtime_detail: JsonObject
    health: JsonObject
    failure_reason: str | None
    decommission: JsonObject | None
    desired_manifest_id: uuid.UUID | None
    desired_app_version: str | None
    previous_manifest_id: uuid.UUID | None
    version: int
    created_at: datetime


@dataclass(frozen=True, slots=True)
class MemberView:
    member_id: uuid.UUID
    instance_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    component_key: str
    allocation_id: uuid.UUID
    status: str
    status_changed_at: datetime
    last_operation_id: uuid.UUID | None
    detail: JsonObject
    tombstoned: bool
    tombstone_reason: str | None
    version: int
    created_at: datetime


@dataclass(frozen=True, slots=True)
class OperationView:
    operation_id: uuid.UUID
    instance_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    app_slug: str
    kind: str
    status: str
    member_id: uuid.UUID | None
    component_key: str | None
    allocation_id: uuid.UUID | None
    params: JsonObject
    claimed_by: str | None
    lease_token: uuid.UUID | None = field(repr=False)
    lease_expires_at: datetime | None
    attempt: int
    progress_message: str
    progress_percent: int | None
    error: str | None
    forced: bool
    result: JsonObject
    result_member_id: uuid.UUID | None
    lease_s: int | None
    deferred_until: datetime | None
    version: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class ClaimView:
    """A claimed operation and the lease that holds it (the token goes to the claimer only)."""

    operation: OperationView
    lease_token: uuid.UUID
    lease_expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class TimelineEntryView:
    seq: int
    instance_id: uuid.UUID
    kind: str
    message: str
    data: JsonObject
    actor: str | None
    occurred_at: datetime


@dataclass(frozen=True, slots=True)
class ControllerBindingView:
    binding_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    app_slug: str
    service_account_id: uuid.UUID
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ManifestView:
    """app_runtime's projection of a catalog manifest."""

    manifest_id: uuid.UUID
    slug: str
    app_version: str
    active: bool
    deprecated: bool
    artifact_ref: str
    revision: int
    state: JsonObject

    @property
    def digest(self) -> str:
        return self.artifact_ref.split("@", 1)[1]


@dataclass(frozen=True, slots=True)
class CredentialView:
    """An access credential's public half (what users see; the sealed private key stays in the row)."""

    credential_id: uuid.UUID
    instance_id: uuid.UUID
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    public_key: str
    fingerprint: str
    custody: str
    status: str
    allocation_ids: list[str]
    rotated_from: uuid.UUID | None
    version: int
    created_at: datetime


@dataclass(frozen=True, slots=True)
class SealedCredential:
    """An active credential with its sealed private key, for the controller's fetch (opened outside the
    transaction: Vault is a network call)."""

    credential: CredentialView
    sealed: Sealed = field(repr=False)


@dataclass(frozen=True, slots=True)
class ControllerCredential(CredentialView):
    """The credential with its private key, answered to the instance's controller only."""

    private_key: str = field(kw_only=True, repr=False)


@dataclass(frozen=True, slots=True)
class IssuedCredential:
    """A new key pair, already sealed by custody (before the transaction that records it)."""

    credential_id: uuid.UUID
    key_pair: KeyPair
    sealed: Sealed = field(repr=False)


def sealed_of(row: Row[Any]) -> Sealed:
    """What custody stored for a credential row."""
    return from_row(Sealed, row)
