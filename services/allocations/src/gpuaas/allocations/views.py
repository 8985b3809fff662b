"""What the use cases answer besides the contract states: small typed view models (pydantic, no I/O).

Their class names are the API's response model names (OpenAPI components), so `api/schemas.py` re-exports
them rather than defining look-alikes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field

from gpuaas.contracts.events.allocations import AllocationState

BodyT = TypeVar("BodyT")


@dataclass(frozen=True)
class AllocationChange(Generic[BodyT]):
    """A change of (or on) an allocation: the answer, the allocation's version after it (the ETag) and
    the host whose agent may have new work (woken at once after the commit)."""

    body: BodyT
    version: int
    host_id: uuid.UUID | None


class VolumeRef(BaseModel):
    volume_id: uuid.UUID
    name: str
    persist: bool
    access_mode: str
    after_release: str


class AllocationNetwork(BaseModel):
    name: str = Field(description="the project network on the host (allocations of other projects are not on it)")
    address: str | None = Field(description="the allocation's address on that network (app controllers use it)")
    hostname: str | None = Field(description="the allocation's hostname (`hostname` inside it)")
    scope: str = Field(
        default="host", description="`host`: only allocations of the project on the same host reach this address"
    )


class Allocation(AllocationState):
    estimated_start_at: datetime | None = Field(
        default=None,
        description="while queued, when it should start where that can be computed: GPUs are being freed for it by "
        "preemption (the latest of its victims' deadlines plus their stop timeout); null when unknown",
    )
    pending_resize_since: datetime | None = Field(
        default=None, description="since when the pending resize (`pending_resize_gpus`) waits; null when none waits"
    )
    volumes: list[VolumeRef] = Field(default_factory=list)
    after_release: str = Field(description="what persists after this allocation is released")
    awaiting_release_clearance: bool = False
    release_evidence: dict[str, Any] | None = Field(
        default=None, description="what the host agent checked when it released the allocation (its own keys)"
    )
    network: AllocationNetwork | None = Field(
        default=None,
        description="where the other allocations of its project reach this one (its project network on its host);"
        " null on hosts that give allocations no network of their own (process driver: the host's address)",
    )


class TimelineEntry(BaseModel):
    seq: int
    entry_id: uuid.UUID
    phase: str
    status: str
    message: str
    task_id: uuid.UUID | None
    started_at: datetime
    finished_at: datetime | None


class SshKey(BaseModel):
    key_id: uuid.UUID
    name: str
    public_key: str
    fingerprint: str
    created_at: datetime


class CapacityQueue(BaseModel):
    """A capacity queue of one pool (GPU model) with its usage now. Without settings (`queue_id` null,
    `version` 0) the defaults apply: no guarantee, no limit, weight 1."""

    queue_id: uuid.UUID | None
    scope: Literal["tenant", "project"]
    scope_id: uuid.UUID
    tenant_id: uuid.UUID
    gpu_model: str
    guarantee: int = 0
    limit: int | None = None
    lend_limit: int | None = None
    weight: float = 1.0
    version: int = 0
    in_use: int = Field(0, description="GPUs of this model its allocations hold")
    borrowed: int = Field(0, description="GPUs held above its guarantee")
    lent: int = Field(0, description="GPUs of its unused (lendable) guarantee that others' borrowing uses now")
    waiting: int = Field(0, description="requests queued for this model")
    waiting_gpus: int = 0
    pending_reasons: dict[str, int] = Field(default_factory=dict, description="waiting requests by reason")


class Quota(BaseModel):
    project_id: uuid.UUID
    max_gpus: int | None
    gpus_in_use: int = 0


class SshHostKey(BaseModel):
    """An allocation's SSH endpoint with the host key the platform pinned for it: what an SSH client must see."""

    host: str
    port: int
    username: str
    host_key: str = Field(description="the pinned host key (`<type> <base64>`, an OpenSSH public key)")
    fingerprint: str | None = Field(default=None, description="its SHA256 fingerprint")
    known_hosts: str = Field(description="a known_hosts line for the endpoint (`[host]:port <type> <base64>`)")


# An agent task as its agent leases it (no docstring: it would change the OpenAPI description).
@dataclass(frozen=True)
class TerminalTarget:
    """The SSH endpoint and account a browser terminal session opens."""

    host: str
    port: int
    username: str
    host_key: str | None = None  # the pinned SSH host key (OpenSSH line); the terminal refuses any other
