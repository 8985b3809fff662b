"""Request and response models of allocations' HTTP surface (the view models the use cases answer are
defined in `gpuaas.allocations.views` and re-exported here under the same names)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from gpuaas.allocations import domain
from gpuaas.allocations.views import Allocation, CapacityQueue, Quota, SshHostKey, SshKey, TimelineEntry, VolumeRef
from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events.allocations import GpuDevice, HostState, VolumeState
from gpuaas.contracts.scalars import Integer, Name, Text

__all__ = [
    "Allocation",
    "AllocationCreate",
    "AttachBody",
    "CapacityQueue",
    "CordonBody",
    "GrantCreate",
    "Host",
    "HostClass",
    "HostClassBody",
    "HostEnrol",
    "HostEnrolment",
    "HostReenrol",
    "HostTenancy",
    "QueueBody",
    "Quota",
    "QuotaBody",
    "ResizeBody",
    "RuntimeOption",
    "SshHostKey",
    "SshKey",
    "SshKeyCreate",
    "TimelineEntry",
    "Volume",
    "VolumeCreate",
    "VolumeRef",
    "enrolment",
    "volume_view",
]

# ------------------------------------------------------------------------------------------------- hosts


class HostPins(BaseModel):
    """The SSH endpoint and host key to pin now (else the agent's first registration pins them)."""

    ssh_host: str | None = Field(None, max_length=255)
    ssh_port: Integer | None = Field(None, ge=1, le=65535)
    ssh_host_key: str | None = Field(
        None, min_length=20, max_length=16_000, description="OpenSSH public key line of the agent's SSH endpoint"
    )

    @model_validator(mode="after")
    def _endpoint_whole(self) -> HostPins:
        if (self.ssh_host is None) != (self.ssh_port is None):
            raise ValueError("ssh_host and ssh_port are pinned together")
        return self

    def pins(self) -> dict[str, Any]:
        return self.model_dump(include={"ssh_host", "ssh_port", "ssh_host_key"}, exclude_none=True)


class HostEnrol(HostPins):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]{0,62}$")
    host_class: str | None = Field(None, max_length=64)
    labels: dict[str, str] = Field(default_factory=dict, max_length=50)
    gpus: list[GpuDevice] = Field(default_factory=list, max_length=64)


class HostReenrol(HostPins):
    reason: Text = Field(min_length=1, max_length=500)


class HostTenancy(BaseModel):
    shared_tenancy_allowed: bool = Field(
        description="let allocations of several tenants share this host although its driver does not isolate them"
    )
    reason: Text = Field(min_length=1, max_length=500)


class HostClassBody(BaseModel):
    default_runtime: str | None = Field(
        None, max_length=200, description="runtime of allocations placed on the class's container hosts"
    )
    cpus_per_gpu: float | None = Field(None, gt=0, le=1024, description="CPUs of a container per GPU it holds")
    memory_mb_per_gpu: Integer | None = Field(None, ge=64, le=16_777_216, description="memory (MB) per GPU")
    pids_limit: Integer = Field(4096, ge=64, le=4_194_304)


class HostClass(HostClassBody):
    name: str
    version: int
    updated_at: datetime


class RuntimeOption(BaseModel):
    slug: str
    version: str
    image: str = Field(description="registry/repository@sha256:... (pinned by digest)")
    digest: str
    display_name: str
    state: str = Field(description="the artifact's lifecycle state: active, or canary for a canary tenant")


class Host(BaseModel):
    host_id: uuid.UUID
    name: str
    status: str
    host_class: str | None
    labels: dict[str, str]
    gpus: list[GpuDevice]
    inventory_source: str = "declared"
    agent_version: str | None = None
    last_heartbeat_at: datetime | None = None
    cordon_reason: str | None = None
    version: int
    driver: Literal["container", "process"] | None = None
    isolates_tenants: bool = False
    shared_tenancy_allowed: bool = False
    cpu_count: int | None = None
    memory_mb: int | None = None
    ssh_host_key_fingerprint: str | None = None


class HostEnrolment(Host):
    node_token: str = Field(description="shown once: the agent presents it to register")


def enrolment(state: HostState, token: str) -> dict[str, Any]:
    return {**state.model_dump(), "node_token": token}


class CordonBody(BaseModel):
    reason: Text = Field(min_length=1, max_length=500)


# ------------------------------------------------------------------------------------------- allocations


class AllocationCreate(BaseModel):
    name: Name = Field("", max_length=100)
    shape: CapacityShape = CapacityShape.gpu_slice
    gpu_model: str = Field(min_length=1, max_length=64, examples=["H100-80GB"])
    gpu_count: Integer | None = Field(
        None,
        ge=1,
        le=64,
        description="required for gpu_slice; a baremetal "
        "allocation takes every GPU of its host (if given, the host must have exactly this many)",
    )
    host_class: str | None = Field(None, max_length=64, description="pin a host class")
    volume_ids: list[uuid.UUID] = Field(default_factory=list, max_length=16, description="volumes to attach at create")
    runtime: str | None = Field(
        None,
        max_length=200,
        description="runtime image: a slug (its newest offered version), slug@version, or the sha256:... digest "
        "of an offered runtime; places on a container host. None: the host class's default (container hosts)",
        examples=["gpuaas-base", "gpuaas-scipy@1.0.0"],
    )
    queue: bool = Field(
        True,
        description="wait `queued` (with a pending_reason and a queue position) when it cannot be placed now "
        "or its project is at its quota; false: answer 409 insufficient_capacity / quota_exceeded at once",
    )
    priority: Integer = Field(
        0, ge=-100, le=100, description="order inside its project's queue: higher first, then older (-100..100)"
    )
    max_wait: Integer | None = Field(
        None, ge=1, le=30 * 86400, description="seconds a queued request waits before it fails with its reason"
    )
    on_preemption: Literal["requeue", "release"] = Field(
        "release", description="what happens to it if it is ever preempted: back in the queue, or released"
    )


class ResizeBody(BaseModel):
    gpu_count: Integer = Field(ge=1, le=64)
    queue: bool = Field(
        True,
        description="a resize up its host cannot give now waits (`pending_resize_gpus`) while the allocation runs "
        "on; false: answer 409 insufficient_gpus_on_host / quota_exceeded / queue_limit_exceeded at once",
    )


# ---------------------------------------------------------------------------------------------- SSH keys


class SshKeyCreate(BaseModel):
    name: Name = Field(min_length=1, max_length=100)
    public_key: str = Field(min_length=20, max_length=16_000)


class GrantCreate(BaseModel):
    user_id: uuid.UUID = Field(description="the project member who gets access")
    public_key: str = Field(min_length=20, max_length=16_000, description="the grantee's own OpenSSH public key")


# ----------------------------------------------------------------------------------------------- volumes


class VolumeCreate(BaseModel):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    size_gb: Integer = Field(ge=1, le=100_000)
    persist: bool = Field(True, description="keep the data after the allocations it is attached to are released")
    access_mode: Literal["single_writer", "multi_attach"] = "single_writer"


class Volume(VolumeState):
    after_release: str


def volume_view(state: VolumeState) -> dict[str, Any]:
    return {**state.model_dump(), "after_release": domain.after_release(state.persist)}


class AttachBody(BaseModel):
    volume_id: uuid.UUID


# ------------------------------------------------------------------------------------------------ quotas


class QueueBody(BaseModel):
    """A capacity queue's figures for one pool (GPU model); what is left out takes its default."""

    guarantee: Integer = Field(0, ge=0, le=100_000, description="GPUs it is entitled to whenever it asks")
    limit: Integer | None = Field(
        None, ge=0, le=100_000, description="most GPUs it may hold, borrowing included (null: no limit)"
    )
    lend_limit: Integer | None = Field(
        None, ge=0, le=100_000, description="most of its unused guarantee others may borrow (null: all of it)"
    )
    weight: float = Field(1.0, gt=0, le=1000, description="its share of the borrowable surplus among its siblings")

    def figures(self) -> dict[str, Any]:
        return self.model_dump(include={"guarantee", "limit", "lend_limit", "weight"})


class QuotaBody(BaseModel):
    max_gpus: Integer = Field(ge=0, le=100_000)


# ------------------------------------------------------------------------------------------------ agents


# The node agent's bodies are the protocol contract: `gpuaas.contracts.agent` (AgentRegistration, TaskLease, ...).
