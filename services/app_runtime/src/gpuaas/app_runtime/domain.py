"""App-runtime rules without I/O: lifecycles as transition tables, placement and deploy checks,
the instance status derived from its members."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema
import jsonschema.validators

from gpuaas.contracts.enums import AllocationStatus, CapacityShape, InstanceStatus
from gpuaas.contracts.events.app_runtime import MemberStatus, OperationKind, OperationStatus
from gpuaas.kit.problems import Conflict, Unprocessable

INSTANCE_TRANSITIONS: dict[InstanceStatus, frozenset[InstanceStatus]] = {
    InstanceStatus.created: frozenset(
        {
            InstanceStatus.starting,
            InstanceStatus.running,
            InstanceStatus.degraded,
            InstanceStatus.failed,
            InstanceStatus.stopping,
            InstanceStatus.decommissioning,
        }
    ),
    InstanceStatus.starting: frozenset(
        {
            InstanceStatus.running,
            InstanceStatus.degraded,
            InstanceStatus.failed,
            InstanceStatus.stopping,
            InstanceStatus.decommissioning,
        }
    ),
    InstanceStatus.running: frozenset(
        {InstanceStatus.degraded, InstanceStatus.stopping, InstanceStatus.failed, InstanceStatus.decommissioning}
    ),
    InstanceStatus.degraded: frozenset(
        {InstanceStatus.running, InstanceStatus.stopping, InstanceStatus.failed, InstanceStatus.decommissioning}
    ),
    InstanceStatus.stopping: frozenset({InstanceStatus.stopped, InstanceStatus.failed, InstanceStatus.decommissioning}),
    InstanceStatus.stopped: frozenset({InstanceStatus.starting, InstanceStatus.decommissioning}),
    InstanceStatus.failed: frozenset(
        {InstanceStatus.starting, InstanceStatus.running, InstanceStatus.degraded, InstanceStatus.decommissioning}
    ),
    InstanceStatus.decommissioning: frozenset({InstanceStatus.decommissioned, InstanceStatus.decommission_failed}),
    # retry of the teardown, or the forced path (recorded as forced)
    InstanceStatus.decommission_failed: frozenset({InstanceStatus.decommissioning, InstanceStatus.decommissioned}),
    InstanceStatus.decommissioned: frozenset(),
}

OPERATION_TRANSITIONS: dict[OperationStatus, frozenset[OperationStatus]] = {
    OperationStatus.pending: frozenset({OperationStatus.claimed, OperationStatus.cancelled, OperationStatus.failed}),
    OperationStatus.claimed: frozenset(
        {
            OperationStatus.in_progress,
            OperationStatus.succeeded,
            OperationStatus.failed,
            OperationStatus.cancelled,
            OperationStatus.pending,
        }
    ),
    OperationStatus.in_progress: frozenset(
        {
            OperationStatus.in_progress,
            OperationStatus.succeeded,
            OperationStatus.failed,
            OperationStatus.cancelled,
            OperationStatus.pending,
        }
    ),
    OperationStatus.succeeded: frozenset(),
    OperationStatus.failed: frozenset({OperationStatus.pending}),  # operator retry
    OperationStatus.cancelled: frozenset({OperationStatus.pending}),  # operator retry
}

TERMINAL_OPS = frozenset({OperationStatus.succeeded, OperationStatus.failed, OperationStatus.cancelled})
OPEN_OPS = frozenset({OperationStatus.pending, OperationStatus.claimed, OperationStatus.in_progress})
# Instance states in which members and operations are driven by the controller and status is derived.
LIVE_INSTANCE = frozenset(
    {
        InstanceStatus.created,
        InstanceStatus.starting,
        InstanceStatus.running,
        InstanceStatus.degraded,
        InstanceStatus.failed,
    }
)
# A member in one of these still has something on its allocation.
MEMBER_GONE = frozenset({MemberStatus.removed, MemberStatus.stopped})
# Operations that need a target member; add creates one.
NEEDS_MEMBER = frozenset({OperationKind.drain, OperationKind.remove, OperationKind.replace, OperationKind.recover})


def check_instance_transition(current: str, target: InstanceStatus) -> None:
    if target not in INSTANCE_TRANSITIONS[InstanceStatus(current)]:
        raise Conflict(f"an instance cannot go from {current} to {target}", code="invalid_instance_transition")


def check_operation_transition(current: str, target: OperationStatus) -> None:
    if target not in OPERATION_TRANSITIONS[OperationStatus(current)]:
        raise Conflict(f"an operation cannot go from {current} to {target}", code="invalid_operation_transition")


@dataclass(frozen=True)
class AllocationView:
    allocation_id: uuid.UUID
    project_id: uuid.UUID
    status: str
    shape: str
    gpu_count: int


def check_placement(
    *,
    project_id: uuid.UUID,
    mode: str,
    controller_allocation_id: uuid.UUID | None,
    worker_allocation_ids: Sequence[uuid.UUID],
    allocations: Mapping[uuid.UUID, AllocationView],
    compatibility: Mapping[str, Any],
) -> None:
    """Refuse a placement that the manifest's compatibility or the allocations do not allow, saying why."""
    if controller_allocation_id is None:
        raise Unprocessable("placement_intent.controller_allocation_id is required", code="placement_invalid")
    if len(set(worker_allocation_ids)) != len(worker_allocation_ids):
        raise Unprocessable("a worker allocation is listed twice", code="placement_invalid")
    if mode == "same_node" and any(w != controller_allocation_id for w in worker_allocation_ids):
        raise Unprocessable(
            "same_node placement puts every member on the controller allocation", code="placement_invalid"
        )
    if mode == "split" and controller_allocation_id in worker_allocation_ids:
        raise Unprocessable("split placement needs workers on other allocations", code="placement_invalid")
    distinct = {controller_allocation_id, *worker_allocation_ids}
    if len(distinct) > 1 and not compatibility.get("multi_allocation", False):
        raise Unprocessable("this app does not span several allocations", code="incompatible_multi_allocation")
    for allocation_id in [controller_allocation_id, *worker_allocation_ids]:
        check_allocation(allocation_id, project_id, allocations.get(allocation_id), compatibility)


def check_allocation(
    allocation_id: uuid.UUID,
    project_id: uuid.UUID,
    alloc: AllocationView | None,
    compatibility: Mapping[str, Any],
) -> None:
    if alloc is None or alloc.project_id != project_id:
        raise Unprocessable(
            f"allocation {allocation_id} is not in this project",
            code="allocation_not_in_project",
            allocation_id=str(allocation_id),
        )
    if alloc.status != AllocationStatus.active:
        raise Conflict(
            f"allocation {allocation_id} is {alloc.status}, not active",
            code="allocation_not_active",
            allocation_id=str(allocation_id),
        )
    shapes = compatibility.get("requires_capacity_shape") or [s.value for s in CapacityShape]
    if alloc.shape not in shapes:
        raise Unprocessable(
            f"allocation {allocation_id} is {alloc.shape}; this app needs {' or '.join(shapes)}",
            code="incompatible_shape",
            allocation_id=str(allocation_id),
        )
    if compatibility.get("requires_exclusive_node") and alloc.shape != CapacityShape.baremetal:
        raise Unprocessable(
            f"this app needs an exclusive node; allocation {allocation_id} is a slice",
            code="incompatible_shape",
            allocation_id=str(allocation_id),
        )
    min_gpus = int(compatibility.get("min_gpu_count", 0) or 0)
    if alloc.gpu_count < min_gpus:
        raise Unprocessable(
            f"allocation {allocation_id} has {alloc.gpu_count} GPUs; this app needs at least {min_gpus}",
            code="insufficient_gpus",
            allocation_id=str(allocation_id),
        )


def validate_config(schema: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """Deploy inputs against the manifest's JSON Schema; every violation is listed."""
    try:
        validator_cls = jsonschema.validators.validator_for(schema)
        validator_cls.check_schema(dict(schema))
    except jsonschema.SchemaError as exc:  # catalog validates manifests; be safe anyway
        raise Unprocessable(f"the app's inputs schema is invalid: {exc.message}", code="app_inputs_invalid") from exc
    errors = sorted(validator_cls(schema).iter_errors(dict(config)), key=lambda e: list(e.path))
    if errors:
        raise Unprocessable(
            "config does not match the app's inputs: " + "; ".join(_describe(e) for e in errors[:10]),
            code="invalid_config",
            errors=[{"path": list(e.path), "message": e.message} for e in errors[:50]],
        )


def _describe(error: jsonschema.ValidationError) -> str:
    where = "/".join(str(p) for p in error.path) or "(root)"
    return f"{where}: {error.message}"


def component_keys(roles: Iterable[Mapping[str, Any]]) -> tuple[str, str]:
    """(controller key, worker key): the manifest's first two adapter roles, else controller/worker."""
    keys = [r["key"] for r in roles if r.get("key")]
    if not keys:
        return "controller", "worker"
    return keys[0], keys[1] if len(keys) > 1 else keys[0]


def check_add_component(roles: Iterable[Mapping[str, Any]], component_key: str, live_keys: Iterable[str]) -> None:
    """An `add` brings up one of the manifest's roles, and never a second member of the controller role
    (the first role, when there are several): a broken controller is replaced or recovered instead."""
    keys = [r["key"] for r in roles if r.get("key")] or list(component_keys([]))
    if component_key not in keys:
        raise Unprocessable(
            f"{component_key!r} is not one of this app's roles ({', '.join(keys)})",
            code="unknown_component_key",
            roles=keys,
        )
    if len(set(keys)) > 1 and component_key == keys[0] and component_key in set(live_keys):
        raise Conflict(
            f"the instance already has a {component_key} member; replace or recover it instead of adding another",
            code="controller_member_exists",
        )


# A member leaving by plan: being removed on request, drained on request, or drained (a live instance's members
# are only drained on request; an instance being stopped is not live).
LEAVING_BY_PLAN = frozenset({MemberStatus.stopping, MemberStatus.draining, MemberStatus.stopped})


def derive_instance_status(current: str, member_statuses: Sequence[str]) -> InstanceStatus:
    """Status of a live instance from its (non-tombstoned) members. A member leaving by plan (removed or
    drained on request) is not a loss: the instance is judged by the members that stay."""
    status = InstanceStatus(current)
    if status not in LIVE_INSTANCE:
        return status
    staying = [s for s in member_statuses if s not in LEAVING_BY_PLAN]
    if staying:
        member_statuses = staying
    if any(s == MemberStatus.failed for s in member_statuses):
        return InstanceStatus.degraded
    if member_statuses and all(s == MemberStatus.active for s in member_statuses):
        return InstanceStatus.running
    if any(s in (MemberStatus.starting, MemberStatus.pending) for s in member_statuses):
        return InstanceStatus.starting if status in (InstanceStatus.created, InstanceStatus.starting) else status
    if status == InstanceStatus.failed:
        return status
    # Every member gone or draining: still degraded relative to what was deployed.
    return InstanceStatus.degraded if status in (InstanceStatus.running, InstanceStatus.degraded) else status


def preemption_drain_skip(instance_status: str, member_status: str, open_kinds: Iterable[str]) -> str | None:
    """Why a member on an allocation about to be preempted gets no drain for the notice (None: drain it).

    Only a live instance's members are drained (a stopping or decommissioning instance takes them away
    already), and only a member that is not leaving yet with no operation open on it: one in flight (its add,
    a drain, a remove) is not doubled, and the allocation's release at the deadline removes the member anyway."""
    if instance_status not in LIVE_INSTANCE:
        return f"the instance is {instance_status}"
    if member_status in LEAVING_BY_PLAN or member_status in MEMBER_GONE:
        return f"the member is {member_status} already"
    if kinds := sorted(set(open_kinds)):
        return f"its {', '.join(kinds)} operation is still open"
    return None


# Role ordering (a manifest role's `after`): what brings a member up, what takes one away.
BRINGS_UP = frozenset({OperationKind.add, OperationKind.replace, OperationKind.recover})
TAKES_AWAY = frozenset({OperationKind.remove, OperationKind.drain})
COMING_UP = frozenset({MemberStatus.pending, MemberStatus.starting})


def role_order(roles: Iterable[Mapping[str, Any]]) -> dict[str, frozenset[str]]:
    """role → the roles it comes after (only roles that come after some other)."""
    return {str(r["key"]): frozenset(r["after"]) for r in roles if r.get("key") and r.get("after")}


@dataclass(frozen=True)
class OpenOperation:
    """What the ordering rule needs of an instance's open operation."""

    operation_id: uuid.UUID
    kind: str
    role: str | None


def ordering_hold(
    kind: str,
    role: str | None,
    order: Mapping[str, frozenset[str]],
    members: Iterable[tuple[str, str]],
    open_operations: Iterable[OpenOperation],
) -> str | None:
    """Why an operation of `kind` on a member of `role` waits for others (None: it may be handed out now).

    `order` is the manifest's role ordering, `members` the instance's live members as (role, status) and
    `open_operations` its other open operations. A role `after` others is brought up only while no member of
    those is still coming up (pending or starting); a member of a role others come after is removed or drained
    only once no member of those others is still being removed or drained (the reverse order)."""
    if role is None or not order:
        return None
    if kind in BRINGS_UP and (before := order.get(role)):
        waiting = sorted({r for r, s in members if r in before and s in COMING_UP})
        if waiting:
            return f"{role} comes up after {', '.join(waiting)}, still coming up"
    if kind in TAKES_AWAY:
        dependents = {r for r, before in order.items() if role in before}
        leaving = sorted({o.role for o in open_operations if o.kind in TAKES_AWAY and o.role in dependents if o.role})
        if leaving:
            return f"{role} is taken away after {', '.join(leaving)}, still being taken away"
    return None


def version_key(version: str) -> tuple[tuple[int, Any], ...]:
    """Natural order of version labels: "1.10" > "1.9" > "1.9-rc1"; digits compare as numbers, a release comes
    after its pre-releases (what follows "-"), build metadata ("+...") is ignored."""
    core, _, pre = version.split("+", 1)[0].partition("-")
    # The release marker sorts below any further core part ("1.9" < "1.9.1") and above a pre-release.
    return (*_natural(core), (-1, ()) if not pre else (-2, _natural(pre)))


def _natural(label: str) -> tuple[tuple[int, int | str], ...]:
    return tuple((1, int(p)) if p.isdigit() else (0, p) for p in re.findall(r"\d+|[a-zA-Z]+", label))


CONTROLLER_STATE_MAX_BYTES = 256 * 1024  # a controller's bookkeeping, not a data store


def check_controller_state_write(current_version: int, expected_version: int, size_bytes: int) -> int:
    """The version a controller-state write gets: `expected_version` must be the stored one (0: none yet),
    else another replica wrote first (409 `state_version_conflict`, re-read and retry); the JSON stays small."""
    if size_bytes > CONTROLLER_STATE_MAX_BYTES:
        raise Unprocessable(
            f"controller state is {size_bytes} bytes; at most {CONTROLLER_STATE_MAX_BYTES} are kept",
            code="controller_state_too_large",
        )
    if expected_version != current_version:
        raise Conflict(
            f"the controller state is at version {current_version}, not {expected_version}; re-read it and retry",
            code="state_version_conflict",
        )
    return current_version + 1
