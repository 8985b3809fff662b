"""Request and response models of allocations' HTTP surface (the view models the use cases answer are
defined in `gpuaas.allocations.views` and re-exported here under the same names)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from gpuaas.allocations import domain
from gpuaas.allocations.views import Allocation, Quota, SshKey, Task, TimelineEntry, VolumeRef
from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events.allocations import GpuDevice, HostState, VolumeState

__all__ = [
    "Allocation",
    "AllocationCreate",
    "AttachBody",
    "Completion",
    "CordonBody",
    "GrantCreate",
    "Host",
    "HostEnrol",
    "HostEnrolment",
    "Progress",
    "Quota",
    "QuotaBody",
    "Register",
    "Registered",
    "ResizeBody",
    "SshKey",
    "SshKeyCreate",
    "Task",
    "TimelineEntry",
    "Volume",
    "VolumeCreate",
    "VolumeRef",
    "enrolment",
    "volume_view",
]

# ------------------------------------------------------------------------------------------------- hosts


class HostEnrol(BaseModel):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]{0,62}$")
    host_class: str | None = Field(None, max_length=64)
    labels: dict[str, str] = Field(default_factory=dict, max_length=50)
    gpus: list[GpuDevice] = Field(default_factory=list, max_length=64)


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


class HostEnrolment(Host):
    node_token: str = Field(description="shown once: the agent presents it to register")


def enrolment(state: HostState, token: str) -> dict[str, Any]:
    return {**state.model_dump(), "node_token": token}


class CordonBody(BaseModel):
    reason: str = Field(min_length=1, max_length=500)


# ------------------------------------------------------------------------------------------- allocations


class AllocationCreate(BaseModel):
    name: str = Field("", max_length=100)
    shape: CapacityShape = CapacityShape.gpu_slice
    gpu_model: str = Field(min_length=1, max_length=64, examples=["H100-80GB"])
    gpu_count: int | None = Field(
        None,
        ge=1,
        le=64,
        description="required for gpu_slice; a baremetal "
        "allocation takes every GPU of its host (if given, the host must have exactly this many)",
    )
    host_class: str | None = Field(None, max_length=64, description="pin a host class")
    volume_ids: list[uuid.UUID] = Field(default_factory=list, max_length=16, description="volumes to attach at create")


class ResizeBody(BaseModel):
    gpu_count: int = Field(ge=1, le=64)


# ---------------------------------------------------------------------------------------------- SSH keys


class SshKeyCreate(BaseModel):
    name: str = Field(min_length=1, max_length=100)
    public_key: str = Field(min_length=20, max_length=16_000)


class GrantCreate(BaseModel):
    user_id: uuid.UUID = Field(description="the project member who gets access")
    public_key: str = Field(min_length=20, max_length=16_000, description="the grantee's own OpenSSH public key")


# ----------------------------------------------------------------------------------------------- volumes


class VolumeCreate(BaseModel):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    size_gb: int = Field(ge=1, le=100_000)
    persist: bool = Field(True, description="keep the data after the allocations it is attached to are released")
    access_mode: Literal["single_writer", "multi_attach"] = "single_writer"


class Volume(VolumeState):
    after_release: str


def volume_view(state: VolumeState) -> dict[str, Any]:
    return {**state.model_dump(), "after_release": domain.after_release(state.persist)}


class AttachBody(BaseModel):
    volume_id: uuid.UUID


# ------------------------------------------------------------------------------------------------ quotas


class QuotaBody(BaseModel):
    max_gpus: int = Field(ge=0, le=100_000)


# ------------------------------------------------------------------------------------------------ agents


class Register(BaseModel):
    agent_version: str = Field(max_length=64)
    gpus: list[GpuDevice] = Field(default_factory=list, max_length=64)
    inventory_source: Literal["nvidia-smi", "declared"] = "declared"
    ssh_host: str = Field(max_length=255)
    ssh_port: int = Field(ge=1, le=65535)


class Registered(BaseModel):
    host_id: uuid.UUID
    name: str
    status: str
    heartbeat_interval_s: float
    ssh_ca_public_key: str = Field(description="trust certificates signed by this key (browser terminal sessions)")


class Progress(BaseModel):
    phase: str = Field(max_length=100)
    status: Literal["started", "succeeded", "failed", "info"] = "info"
    message: str = Field("", max_length=2000)
    started_at: datetime | None = None
    finished_at: datetime | None = None


class Completion(BaseModel):
    ok: bool
    message: str = Field("", max_length=4000)
    result: dict[str, Any] = Field(default_factory=dict)
