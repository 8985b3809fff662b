"""Allocation rules without I/O: the lifecycle transition table, placement choice, key parsing."""

from __future__ import annotations

import base64
import hashlib
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from gpuaas.contracts.enums import AllocationStatus, CapacityShape
from gpuaas.contracts.events.allocations import HostStatus
from gpuaas.kit.problems import Conflict, Unprocessable

# FROM -> allowed TO (ARCHITECTURE §6). `failed` and `released` are final.
TRANSITIONS: dict[AllocationStatus, frozenset[AllocationStatus]] = {
    AllocationStatus.requested: frozenset(
        {AllocationStatus.provisioning, AllocationStatus.queued, AllocationStatus.failed}
    ),
    # Waiting for capacity (issue 29): admitted with a placement, failed past max_wait, released on cancel.
    AllocationStatus.queued: frozenset(
        {AllocationStatus.provisioning, AllocationStatus.failed, AllocationStatus.released}
    ),
    AllocationStatus.provisioning: frozenset({AllocationStatus.active, AllocationStatus.failed}),
    AllocationStatus.active: frozenset(
        {AllocationStatus.restarting, AllocationStatus.resizing, AllocationStatus.releasing}
    ),
    AllocationStatus.restarting: frozenset({AllocationStatus.active, AllocationStatus.releasing}),
    AllocationStatus.resizing: frozenset({AllocationStatus.active, AllocationStatus.releasing}),
    AllocationStatus.releasing: frozenset({AllocationStatus.released, AllocationStatus.release_failed}),
    AllocationStatus.release_failed: frozenset({AllocationStatus.releasing}),
    AllocationStatus.released: frozenset(),
    AllocationStatus.failed: frozenset(),
}

# Statuses that hold GPUs on a host (and count against the project quota); `queued` holds none.
HOLDS_CAPACITY = frozenset(
    {
        AllocationStatus.requested,
        AllocationStatus.provisioning,
        AllocationStatus.active,
        AllocationStatus.restarting,
        AllocationStatus.resizing,
        AllocationStatus.releasing,
        AllocationStatus.release_failed,
    }
)
TERMINAL = frozenset({AllocationStatus.released, AllocationStatus.failed})


def check_transition(current: str, target: AllocationStatus, *, action: str) -> None:
    """Refuse a transition the table does not allow, with a reason the caller can act on."""
    frm = AllocationStatus(current)
    if target not in TRANSITIONS[frm]:
        raise Conflict(
            f"cannot {action} an allocation that is {frm.value}",
            code="invalid_state_transition",
            current_status=frm.value,
            requested=target.value,
        )


def check_queue_figures(*, guarantee: int, limit: int | None, lend_limit: int | None, weight: float) -> None:
    """A capacity queue's own figures (issue 29): nothing negative, a guarantee within the limit, a positive
    weight, and no more lent than guaranteed."""
    if guarantee < 0 or (limit is not None and limit < 0) or (lend_limit is not None and lend_limit < 0):
        raise Unprocessable("queue figures cannot be negative", code="invalid_queue")
    if limit is not None and guarantee > limit:
        raise Unprocessable(f"the guarantee ({guarantee}) is above the limit ({limit})", code="guarantee_above_limit")
    if lend_limit is not None and lend_limit > guarantee:
        raise Unprocessable(
            f"lend_limit ({lend_limit}) is above the guarantee ({guarantee}): only unused guarantee can be lent",
            code="invalid_queue",
        )
    if not weight > 0:
        raise Unprocessable("the weight must be above 0", code="invalid_queue")


def check_project_share(
    *, tenant_guarantee: int, tenant_limit: int | None, other_projects_guarantee: int, guarantee: int, limit: int | None
) -> None:
    """A tenant's admins divide the tenant's share among its projects, never beyond it: the projects'
    guarantees sum to at most the tenant's guarantee, and no project's limit is above the tenant's (a
    project without a limit is still held to its tenant's by admission)."""
    if other_projects_guarantee + guarantee > tenant_guarantee:
        raise Unprocessable(
            f"the tenant's projects would be guaranteed {other_projects_guarantee + guarantee} GPUs of this model; "
            f"the tenant is guaranteed {tenant_guarantee}",
            code="project_guarantees_above_tenant",
            tenant_guarantee=tenant_guarantee,
            other_projects=other_projects_guarantee,
        )
    if tenant_limit is not None and limit is not None and limit > tenant_limit:
        raise Unprocessable(
            f"the project's limit ({limit}) is above the tenant's limit ({tenant_limit})",
            code="project_limit_above_tenant",
            tenant_limit=tenant_limit,
        )


def unix_username(allocation_id: uuid.UUID) -> str:
    """The allocation's Unix account: short, stable, valid as a POSIX user name."""
    return "a" + allocation_id.hex[-11:]


@dataclass(frozen=True)
class HostCapacity:
    host_id: uuid.UUID
    name: str
    status: str
    host_class: str | None
    gpu_indices_by_model: dict[str, list[int]]  # model -> every index of that model
    used: frozenset[int]

    def free(self, model: str) -> list[int]:
        return [i for i in self.gpu_indices_by_model.get(model, []) if i not in self.used]

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.gpu_indices_by_model.values())


def candidates(
    hosts: Iterable[HostCapacity], *, shape: CapacityShape, model: str, count: int, host_class: str | None
) -> list[HostCapacity]:
    """Hosts that can take the request, best fit first (fewest free GPUs left over), so large
    slices and whole hosts stay available."""
    fit: list[HostCapacity] = []
    for h in hosts:
        if h.status != HostStatus.ready or (host_class and h.host_class != host_class):
            continue
        if shape is CapacityShape.baremetal:
            if not h.used and h.gpu_indices_by_model.get(model) and h.total == len(h.gpu_indices_by_model[model]):
                fit.append(h)
        elif len(h.free(model)) >= count:
            fit.append(h)
    return sorted(fit, key=lambda h: (len(h.free(model)) - count, h.name))


def pick_gpus(host: HostCapacity, *, shape: CapacityShape, model: str, count: int) -> list[int] | None:
    free = host.free(model)
    if shape is CapacityShape.baremetal:
        return sorted(host.gpu_indices_by_model.get(model, [])) if not host.used else None
    return sorted(free)[:count] if len(free) >= count else None


def parse_public_key(line: str) -> tuple[str, str]:
    """Validate an OpenSSH public key line; return (normalised line, SHA256 fingerprint)."""
    parts = line.strip().split()
    if len(parts) < 2 or not parts[0].startswith(("ssh-", "ecdsa-", "sk-")):
        raise Unprocessable("public_key must be an OpenSSH public key line", code="invalid_public_key")
    try:
        blob = base64.b64decode(parts[1], validate=True)
    except ValueError:
        raise Unprocessable("public_key is not valid base64", code="invalid_public_key") from None
    if len(blob) < 20 or blob[4 : 4 + int.from_bytes(blob[:4], "big")].decode(errors="replace") != parts[0]:
        raise Unprocessable("public_key does not match its key type", code="invalid_public_key")
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    return " ".join(parts[:3]), f"SHA256:{digest}"


def after_release(persist: bool) -> str:
    return (
        "kept: the volume and its data survive the release of its allocations"
        if persist
        else "deleted: the data is removed when the last allocation it is attached to is released"
    )


def allocation_after_release(volumes: list[tuple[str, bool]]) -> str:
    """What a user keeps when they release the allocation (said on every allocation response)."""
    parts = ["the workspace, scratch and processes are deleted"]
    kept = [n for n, p in volumes if p]
    gone = [n for n, p in volumes if not p]
    if kept:
        parts.append("volumes kept: " + ", ".join(kept))
    if gone:
        parts.append("volumes deleted: " + ", ".join(gone))
    if not volumes:
        parts.append("no volume is attached, so nothing persists")
    return "; ".join(parts)


# ----------------------------------------------------------------------------------------- isolation

DEFAULT_RUNTIME = "gpuaas-base"  # the platform default on container hosts when the class names none
DEFAULT_PIDS_LIMIT = 4096
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_SLUG = re.compile(r"^[a-z0-9][a-z0-9-]*$")


@dataclass(frozen=True)
class RuntimeSpec:
    """What a create's `runtime` names: a slug (its newest offered version), slug@version, or a digest."""

    slug: str | None = None
    version: str | None = None
    digest: str | None = None


def parse_runtime_spec(value: str) -> RuntimeSpec:
    value = value.strip()
    if _DIGEST.match(value):
        return RuntimeSpec(digest=value)
    slug, _, version = value.partition("@")
    if not _SLUG.match(slug) or (version == "" and "@" in value):
        raise Unprocessable(
            f"runtime {value!r} is not a runtime slug, slug@version or sha256:<64 hex> digest",
            code="runtime_unavailable",
        )
    return RuntimeSpec(slug=slug, version=version or None)


def version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """Order versions the semver way for "newest": numeric parts numerically, a release after its pre-release."""
    core, _, pre = version.partition("-")
    parts: list[tuple[int, int | str]] = [(0, int(p)) if p.isdigit() else (1, p) for p in core.split(".")]
    parts.append((1, "~") if not pre else (0, pre))  # "~" sorts after any pre-release tag
    return tuple(parts)


@dataclass(frozen=True)
class ClassFigures:
    """A host class's figures per GPU (None: not set, the host's share applies) and its pids limit."""

    cpus_per_gpu: float | None = None
    memory_mb_per_gpu: int | None = None
    pids_limit: int = DEFAULT_PIDS_LIMIT


def allocation_limits(
    figures: ClassFigures | None, *, gpu_count: int, host_cpus: int | None, host_memory_mb: int | None, host_gpus: int
) -> dict[str, float | int] | None:
    """CPU and memory of an allocation's container: the class figures x its GPUs where the class sets
    them, else its share of the host (host figure x gpus / host GPUs). None when neither is known."""
    figures = figures or ClassFigures()
    share = gpu_count / host_gpus if host_gpus > 0 else 1.0
    cpus: float | None = (
        figures.cpus_per_gpu * gpu_count
        if figures.cpus_per_gpu is not None
        else (host_cpus * share if host_cpus else None)
    )
    memory: int | None = (
        figures.memory_mb_per_gpu * gpu_count
        if figures.memory_mb_per_gpu is not None
        else (int(host_memory_mb * share) if host_memory_mb else None)
    )
    if cpus is None or memory is None or cpus <= 0 or memory <= 0:
        return None
    return {"cpus": round(cpus, 3), "memory_mb": memory, "pids": figures.pids_limit}


def tenancy_allows(*, isolates_tenants: bool, shared_tenancy_allowed: bool, other_tenants_present: bool) -> bool:
    """A host that does not isolate tenants takes one tenant at a time, unless an operator allowed sharing."""
    return isolates_tenants or shared_tenancy_allowed or not other_tenants_present


@dataclass(frozen=True)
class Holding:
    """GPUs held from `start` until `end` (None: still held), in seconds on any common clock."""

    gpus: int
    start: float
    end: float | None


def window_use(holdings: Iterable[Holding], start: float, end: float) -> tuple[int, float]:
    """The most GPUs held at once in the window (start, end], and the time-weighted mean held over it.

    What a chart sampled at instants misses: an allocation placed and released between two samples
    shows in neither sample, but in the peak and the mean of the window between them."""
    span = end - start
    if span <= 0:
        raise ValueError("the window must end after it starts")
    live = [h for h in holdings if h.start <= end and (h.end is None or h.end > start)]
    gpu_seconds = sum(h.gpus * (min(end, h.end if h.end is not None else end) - max(start, h.start)) for h in live)
    # Sweep: what is held just after `start`, then each change inside the window (a release before a
    # placement at the same instant: a GPU handed over is not counted twice).
    held = sum(h.gpus for h in live if h.start <= start)
    changes = sorted(
        [(h.start, 1, h.gpus) for h in live if h.start > start]
        + [(h.end, 0, -h.gpus) for h in live if h.end is not None and h.end <= end]
    )
    peak = held
    for _, _, delta in changes:
        held += delta
        peak = max(peak, held)
    return peak, gpu_seconds / span
