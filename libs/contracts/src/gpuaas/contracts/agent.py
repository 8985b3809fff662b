"""The control plane ⇄ node agent protocol (allocations' `/agent/*` routes), typed end to end.

The agent dials out with its node token:

    POST /agent/register                 AgentRegistration → AgentRegistered
    POST /agent/heartbeat                (no body)         → HeartbeatAck
    GET  /agent/tasks?wait_s=            → list[TaskLease]  (each lease carries one `AgentTask`)
    POST /agent/tasks/{id}/progress      TaskProgress
    POST /agent/tasks/{id}/complete      TaskCompletion    (its `result` is the task kind's `AgentResult`)

A task is one model per kind (`ProvisionTask`, `RestartTask`, …), a union discriminated on `kind`
(`AgentTask`); its outcome likewise (`ProvisionResult`, … → `AgentResult`). Both carry `kind` on the
wire; rows and reports written before the field existed lack it, so `parse_task` / `parse_result` take
the kind from where it was kept (the task row's `kind` column, the lease's `kind`).

Compatibility (an agent one version behind the control plane keeps working, and the other way round):
- every model ignores unknown fields (`extra="ignore"`): a newer control plane may add optional input
  fields an older agent does not know, a newer agent may report fields an older service does not know;
- new fields are optional with a default; a failed task reports `result: {}`, so every result field is
  optional, and a result from an older agent (without a newer field) validates;
- the schemas are exported to `libs/contracts/schemas/agent/` and held to the release baseline like the
  event schemas (`gpuaas.contracts.compat`): removing a field, making one required, narrowing a type fails.
Parts of a result the service used to check leniently (the network address, the workload's port, the
release evidence) stay lenient: a malformed part is dropped, never the whole completion, because a refused
completion would be reported again by the agent forever.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from ipaddress import IPv4Address, IPv4Network, IPv6Address
from typing import Annotated, Literal, TypeVar, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)

from gpuaas.contracts.events.allocations import AllocationLimits, GpuDevice, WorkloadSpec
from gpuaas.contracts.scalars import Digest, Integer, Text, Timestamp

PROTOCOL_VERSION = 1
"""Raised only for a change an agent one version behind cannot follow (never within the compatibility rules)."""

NETWORK_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


class AgentModel(BaseModel):
    """Base of every protocol body. `extra="ignore"` (not "forbid"): the two sides upgrade independently,
    and a field one side added must not make the other refuse the message; not "allow" either, so that
    what a side stores or acts on is only what it understands."""

    model_config = ConfigDict(extra="ignore")


def _or_none(value: object, handler: ValidatorFunctionWrapHandler) -> object:
    """A malformed optional part becomes None instead of refusing the whole message (see the module doc)."""
    try:
        return handler(value)
    except ValidationError:
        return None


# --------------------------------------------------------------------------------------- task inputs


class VolumeMount(AgentModel):
    volume_id: uuid.UUID
    mount_path: str = Field(max_length=4096, description="absolute path inside the allocation")


class ReleaseVolume(AgentModel):
    volume_id: uuid.UUID
    delete_data: bool = Field(default=False, description="not persistent and attached nowhere else: delete it")


class RuntimeImage(AgentModel):
    """The runtime image of a container allocation; the agent pulls it by digest and checks the content."""

    image: str = Field(max_length=1024, description="registry/repo@sha256:<hex>")
    digest: Digest


class OverlayPeer(AgentModel):
    """A host of the project's overlay segment: its enrolled underlay address and the members it holds."""

    underlay: IPv4Address
    addresses: list[IPv4Address] = Field(default_factory=list, max_length=4096)


class OverlaySpec(AgentModel):
    """The project's network across hosts (issue 27): a VXLAN segment (`vni`) over the hosts' enrolled addresses,
    the project's subnet (gateway: its first address, on every host), the allocation's address on it (assigned by
    the allocations service, kept for the allocation's life; None in a peer update), this host's underlay address,
    every host of the segment with its members (this one included), and the members' names
    (`<allocation name>.<project>` → address). A heartbeat's answer lists one per project on the host (its
    `project_id` set): how the peers and names follow members coming and going."""

    project_id: uuid.UUID | None = None
    vni: int = Field(ge=1, le=(1 << 24) - 1)
    subnet: IPv4Network
    address: IPv4Address | None = None
    underlay: IPv4Address
    peers: list[OverlayPeer] = Field(default_factory=list, max_length=4096)
    names: dict[str, IPv4Address] = Field(default_factory=dict)


class TaskInput(AgentModel):
    """Base of every task's input (the members of `AgentTask`)."""

    allocation_id: uuid.UUID


class WorkspaceSpec(TaskInput):
    """What the agent (re)builds an allocation's workspace from: account, GPUs, keys, volumes, and on a
    container host the runtime image and the container's limits (None on a process host)."""

    username: str = Field(max_length=64, description="the allocation's Unix account")
    gpu_indices: list[int] = Field(default_factory=list)
    authorized_keys: list[str] = Field(default_factory=list, description="OpenSSH public key lines")
    volumes: list[VolumeMount] = Field(default_factory=list)
    project_id: uuid.UUID | None = Field(default=None, description="the container driver's project network")
    tenant_id: uuid.UUID | None = None
    runtime: RuntimeImage | None = None
    limits: AllocationLimits | None = None
    workload: WorkloadSpec | None = Field(default=None, description="a launchable app's workload (issue 21)")
    workload_token: str | None = Field(default=None, description="the workload's per-instance secret")
    overlay: OverlaySpec | None = Field(default=None, description="the project's segment across hosts (issue 27)")


class ProvisionTask(WorkspaceSpec):
    kind: Literal["provision"] = "provision"


class RestartTask(WorkspaceSpec):
    """Stop every process of the allocation and start it again from this spec (keys, GPUs, volumes)."""

    kind: Literal["restart"] = "restart"


class ResizeTask(TaskInput):
    kind: Literal["resize"] = "resize"
    username: str = Field(max_length=64)
    gpu_indices: list[int] = Field(default_factory=list, description="the allocation's GPUs after the resize")
    runtime: RuntimeImage | None = None
    limits: AllocationLimits | None = Field(default=None, description="the container's limits at the new size")
    workload: WorkloadSpec | None = None
    workload_token: str | None = None
    overlay: OverlaySpec | None = Field(default=None, description="kept: a recreated container keeps its address")


class SyncSshKeysTask(TaskInput):
    kind: Literal["sync_ssh_keys"] = "sync_ssh_keys"
    username: str = Field(default="", max_length=64)
    authorized_keys: list[str] = Field(default_factory=list)


class AttachVolumeTask(TaskInput):
    kind: Literal["attach_volume"] = "attach_volume"
    volume_id: uuid.UUID
    mount_path: str = Field(max_length=4096)


class DetachVolumeTask(TaskInput):
    kind: Literal["detach_volume"] = "detach_volume"
    volume_id: uuid.UUID
    mount_path: str = Field(max_length=4096)
    delete_data: bool = False


class ReleaseTask(TaskInput):
    kind: Literal["release"] = "release"
    username: str = Field(max_length=64)
    volumes: list[ReleaseVolume] = Field(default_factory=list)
    stop_timeout_s: float | None = Field(
        default=None,
        ge=0,
        le=600,
        description="a preemption's stop: SIGTERM, then SIGKILL after this many seconds (None: kill at once)",
    )


class NotifyPreemptionTask(TaskInput):
    """Tell an allocation it will be preempted (issue 29): /run/gpuaas/preemption inside it (JSON: deadline,
    reason) and a message on its open SSH sessions."""

    kind: Literal["notify_preemption"] = "notify_preemption"
    username: str = Field(max_length=64)
    deadline: Timestamp
    reason: str = Field(max_length=64)
    on_preemption: Literal["requeue", "release"] = "release"


AgentTask = Annotated[
    ProvisionTask
    | RestartTask
    | ResizeTask
    | SyncSshKeysTask
    | AttachVolumeTask
    | DetachVolumeTask
    | ReleaseTask
    | NotifyPreemptionTask,
    Field(discriminator="kind"),
]
"""A task's input, discriminated on `kind`."""

TASK_TYPES: tuple[type[TaskInput], ...] = (
    ProvisionTask,
    RestartTask,
    ResizeTask,
    SyncSshKeysTask,
    AttachVolumeTask,
    DetachVolumeTask,
    ReleaseTask,
    NotifyPreemptionTask,
)
TaskKind = Literal[
    "provision",
    "restart",
    "resize",
    "sync_ssh_keys",
    "attach_volume",
    "detach_volume",
    "release",
    "notify_preemption",
]


# ------------------------------------------------------------------------------------- task outcomes


class NetworkInfo(AgentModel):
    """Where other allocations of the project reach this one (container driver): the project network on the
    host, the allocation's address and hostname there. An invalid address or hostname is dropped (None)."""

    name: str = Field(pattern=NETWORK_NAME_PATTERN)
    address: Annotated[IPv4Address | IPv6Address | None, WrapValidator(_or_none)] = None
    hostname: Annotated[str | None, Field(pattern=NETWORK_NAME_PATTERN), WrapValidator(_or_none)] = None
    scope: str = Field(default="host", max_length=32, description="`host`: reachable from the same host only")


class WorkloadReport(AgentModel):
    """A launchable workload's published host port once its health check answered."""

    host_port: int = Field(ge=1, le=65535)
    healthy: bool = False
    health_s: float | None = Field(default=None, description="seconds until the health check answered")


class ReleaseEvidence(BaseModel):
    """What the agent checked after removing an allocation (None: not applicable to its driver).

    `extra="allow"` (unlike the rest of the protocol): the evidence is a record kept verbatim for operators,
    and a check a newer agent adds must be kept rather than silently dropped."""

    model_config = ConfigDict(extra="allow")

    driver: str | None = None
    container: str | None = None
    container_removed: bool | None = None
    cgroup_empty: bool | None = None
    pid_namespace_gone: bool | None = None
    mounts_gone: bool | None = None
    state_dir_gone: bool | None = None
    processes_left: list[int] | None = None
    checked: list[str] = Field(default_factory=list, description="one line per check, as the agent made it")

    def summary(self) -> str:
        """One line for the timeline: each boolean check and its outcome, then what it lists."""
        flags = [f"{k}={'yes' if v else 'NO'}" for k, v in self.model_dump().items() if isinstance(v, bool)]
        listed = f"; checked: {', '.join(self.checked)}" if self.checked else ""
        return "release evidence: " + (", ".join(flags) or "none reported") + listed


Network = Annotated[NetworkInfo | None, WrapValidator(_or_none)]


class TaskOutcome(AgentModel):
    """Base of every task's result (the members of `AgentResult`)."""


class ProvisionResult(TaskOutcome):
    """The agent's SSH endpoint is informative only (the enrolled endpoint is used)."""

    kind: Literal["provision"] = "provision"
    ssh_host: str | None = None
    ssh_port: int | None = None
    username: str | None = None
    driver: str | None = None
    network: Network = Field(default=None, description="absent: an older agent (the service keeps what it had)")
    workload: Annotated[WorkloadReport | None, WrapValidator(_or_none)] = None


class RestartResult(TaskOutcome):
    kind: Literal["restart"] = "restart"
    network: Network = None
    workload: Annotated[WorkloadReport | None, WrapValidator(_or_none)] = None


class ResizeResult(TaskOutcome):
    kind: Literal["resize"] = "resize"
    gpu_indices: list[int] = Field(default_factory=list)
    network: Network = Field(default=None, description="a recreated container may have a new address")


class SyncSshKeysResult(TaskOutcome):
    kind: Literal["sync_ssh_keys"] = "sync_ssh_keys"
    keys: int | None = Field(default=None, description="keys installed")
    skipped: str | None = Field(default=None, description="why nothing was done (no workspace on this host)")
    sessions_closed: int | None = Field(default=None, description="open SSH connections of removed keys closed")


class AttachVolumeResult(TaskOutcome):
    kind: Literal["attach_volume"] = "attach_volume"
    mounted_at: str | None = None
    message: str | None = None


class DetachVolumeResult(TaskOutcome):
    kind: Literal["detach_volume"] = "detach_volume"


class ReleaseResult(TaskOutcome):
    kind: Literal["release"] = "release"
    verified: bool = False
    evidence: Annotated[ReleaseEvidence | None, WrapValidator(_or_none)] = None


class NotifyPreemptionResult(TaskOutcome):
    kind: Literal["notify_preemption"] = "notify_preemption"
    file_written: bool = False
    sessions_notified: int = Field(default=0, ge=0, description="open SSH sessions the message was written to")


AgentResult = Annotated[
    ProvisionResult
    | RestartResult
    | ResizeResult
    | SyncSshKeysResult
    | AttachVolumeResult
    | DetachVolumeResult
    | ReleaseResult
    | NotifyPreemptionResult,
    Field(discriminator="kind"),
]
"""A task's outcome, discriminated on `kind` (the task's kind)."""

RESULT_TYPES: tuple[type[TaskOutcome], ...] = (
    ProvisionResult,
    RestartResult,
    ResizeResult,
    SyncSshKeysResult,
    AttachVolumeResult,
    DetachVolumeResult,
    ReleaseResult,
    NotifyPreemptionResult,
)

_TASKS: TypeAdapter[AgentTask] = TypeAdapter(AgentTask)
_RESULTS: TypeAdapter[AgentResult] = TypeAdapter(AgentResult)


def _with_kind(kind: str, raw: object) -> object:
    """`raw` with `kind` added when it has none (written before the field existed); a contradicting one stays
    and is refused by the union."""
    if not isinstance(raw, dict):
        return raw
    fields = cast(dict[str, object], raw)
    return fields if "kind" in fields else {**fields, "kind": kind}


K = TypeVar("K", bound=AgentModel)


def _same_kind(kind: str, parsed: K) -> K:
    if getattr(parsed, "kind", kind) != kind:
        raise KindMismatch(f"a {kind!r} task's message says kind {getattr(parsed, 'kind', None)!r}")
    return parsed


class KindMismatch(ValueError):
    """A payload or result whose `kind` contradicts the task's."""


def parse_task(kind: str, payload: object) -> AgentTask:
    """A task's input from its kind and stored/sent payload (raises ValueError: pydantic.ValidationError, also
    for a kind this version does not know, or KindMismatch)."""
    return _same_kind(kind, _TASKS.validate_python(_with_kind(kind, payload)))


def parse_result(kind: str, result: object) -> AgentResult:
    """A task's outcome from the task's kind and the reported result (`{}` for a failed task validates); raises
    like `parse_task`."""
    return _same_kind(kind, _RESULTS.validate_python(_with_kind(kind, result)))


def kind_of(task_type: type[BaseModel]) -> str:
    """The `kind` a task or result model is discriminated by."""
    default = task_type.model_fields["kind"].default
    assert isinstance(default, str)
    return default


# ------------------------------------------------------------------------------------------ sessions


class AgentRegistration(AgentModel):
    """The agent (re)starts: its inventory, driver and SSH endpoint (pinned by the first registration)."""

    agent_version: str = Field(max_length=64)
    gpus: list[GpuDevice] = Field(default_factory=list, max_length=64)
    inventory_source: Literal["nvidia-smi", "declared"] = "declared"
    ssh_host: str = Field(max_length=255)
    ssh_port: Integer = Field(ge=1, le=65535)
    driver: Literal["container", "process"] | None = None
    isolates_tenants: bool = False
    cpu_count: Integer | None = Field(default=None, ge=1, le=65_536)
    memory_mb: Integer | None = Field(default=None, ge=1)
    ssh_host_key: str | None = Field(
        default=None, min_length=20, max_length=16_000, description="OpenSSH public key line of the agent's endpoint"
    )
    reconciled: dict[str, JsonValue] | None = Field(
        default=None, description="what the agent removed/recreated before registering (logged by the service)"
    )


class AgentRegistered(AgentModel):
    host_id: uuid.UUID
    name: str
    status: str
    heartbeat_interval_s: float | None = Field(default=None, description="None: the agent keeps its own")
    ssh_ca_public_key: str | None = Field(
        default=None, description="trust certificates signed by this key (browser terminal sessions)"
    )


class HeartbeatAck(AgentModel):
    host_id: uuid.UUID
    status: str
    overlays: list[OverlaySpec] | None = Field(
        default=None,
        description="the segments of the projects with allocations on this host, as they are now (None: an older "
        "service; the agent keeps what it has)",
    )


class TaskLease(AgentModel):
    """A leased task (GET /agent/tasks): the agent reports it before the lease expires, else it returns to the
    queue. `kind` stays beside `payload` (agents before the typed protocol read it there)."""

    task_id: uuid.UUID
    kind: str
    allocation_id: uuid.UUID | None = None
    payload: AgentTask
    attempts: int = 0
    lease_expires_at: Timestamp | None = None

    @model_validator(mode="before")
    @classmethod
    def _payload_kind(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        fields = cast(dict[str, object], data)
        kind = fields.get("kind")
        return {**fields, "payload": _with_kind(kind, fields.get("payload"))} if isinstance(kind, str) else fields

    @model_validator(mode="after")
    def _same_kind(self) -> TaskLease:
        if self.payload.kind != self.kind:
            raise ValueError(f"the lease's kind {self.kind!r} is not its payload's {self.payload.kind!r}")
        return self


class TaskProgress(AgentModel):
    """A step of a task (a timeline entry); it also extends the task's lease."""

    phase: str = Field(max_length=100)
    status: Literal["started", "succeeded", "failed", "info"] = "info"
    message: Text = Field(default="", max_length=2000)
    started_at: Timestamp | None = None
    finished_at: Timestamp | None = None


class TaskCompletion(AgentModel):
    """A task's outcome, applied once (a repeat is a no-op). `result` is the task kind's `AgentResult` (the
    service parses it with the kind of the task it leased: `parse_result`); `{}` when `ok` is false."""

    ok: bool
    message: Text = Field(default="", max_length=4000)
    result: dict[str, JsonValue] = Field(default_factory=dict)


class CompletionAck(AgentModel):
    applied: bool = Field(description="false: the outcome had been applied already")


# ---------------------------------------------------------------------------------------- the schemas

MESSAGES: dict[str, type[BaseModel]] = {
    "AgentRegistration": AgentRegistration,
    "AgentRegistered": AgentRegistered,
    "HeartbeatAck": HeartbeatAck,
    "TaskLease": TaskLease,
    "TaskProgress": TaskProgress,
    "TaskCompletion": TaskCompletion,
    "CompletionAck": CompletionAck,
}
"""The protocol's bodies by name; each task and result model is exported on its own too (schemas/agent/)."""


M = TypeVar("M", bound=BaseModel)


def complete_table(table: Mapping[type[M], object], members: tuple[type[M], ...], what: str) -> None:
    """Raise unless `table` has exactly one entry per member of a union (checked at import by each side)."""
    missing = [m.__name__ for m in members if m not in table]
    extra = [k.__name__ for k in table if k not in members]
    if missing or extra:
        raise TypeError(f"{what}: no handler for {missing}; handlers for unknown types {extra}")
