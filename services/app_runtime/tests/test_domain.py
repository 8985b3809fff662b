"""App-runtime rules without I/O (gpuaas.app_runtime.domain): instance and operation lifecycles, placement on
allocations, deploy inputs, member roles, the instance status derived from its members, and controller state."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import pytest

from gpuaas.app_runtime.domain import (
    CONTROLLER_STATE_MAX_BYTES,
    AllocationView,
    check_add_component,
    check_controller_state_write,
    check_instance_transition,
    check_operation_transition,
    check_placement,
    component_keys,
    derive_instance_status,
    validate_config,
    version_key,
)
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events.app_runtime import MemberStatus, OperationStatus
from gpuaas.kit.problems import Problem

IS, OS, MS = InstanceStatus, OperationStatus, MemberStatus


def problem_of(call: Any, *args: Any, **kwargs: Any) -> Problem:
    with pytest.raises(Problem) as caught:
        call(*args, **kwargs)
    return caught.value


# ------------------------------------------------------------------------------------ instance lifecycle


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (IS.created, IS.starting),
        (IS.starting, IS.running),
        (IS.running, IS.degraded),
        (IS.degraded, IS.running),  # a member recovered
        (IS.running, IS.stopping),
        (IS.stopping, IS.stopped),
        (IS.stopped, IS.starting),
        (IS.failed, IS.starting),
        (IS.running, IS.decommissioning),
        (IS.decommissioning, IS.decommissioned),
        (IS.decommissioning, IS.decommission_failed),
        (IS.decommission_failed, IS.decommissioning),  # teardown retried
        (IS.decommission_failed, IS.decommissioned),  # forced
    ],
)
def test_instance_moves_on_the_lifecycle(current: IS, target: IS) -> None:
    check_instance_transition(current.value, target)


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (IS.stopped, IS.running),  # a stopped instance starts again through `starting`
        (IS.running, IS.created),
        (IS.running, IS.stopped),  # stopping first: the members are torn down
        (IS.running, IS.decommissioned),  # only after a verified teardown
        (IS.stopping, IS.running),
        (IS.decommissioning, IS.running),
        (IS.decommissioned, IS.decommissioning),
        (IS.decommissioned, IS.starting),
    ],
)
def test_instance_moves_off_the_lifecycle_are_409(current: IS, target: IS) -> None:
    problem = problem_of(check_instance_transition, current.value, target)
    assert (problem.status, problem.code) == (409, "invalid_instance_transition")


def test_a_decommissioned_instance_goes_nowhere() -> None:
    for target in IS:
        assert problem_of(check_instance_transition, "decommissioned", target).code == "invalid_instance_transition"


def test_every_instance_status_can_still_be_decommissioned_until_it_is() -> None:
    for status in set(IS) - {IS.decommissioning, IS.decommissioned}:
        check_instance_transition(status.value, IS.decommissioning)


# ----------------------------------------------------------------------------------- operation lifecycle


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (OS.pending, OS.claimed),
        (OS.claimed, OS.in_progress),
        (OS.in_progress, OS.in_progress),  # progress reported again
        (OS.in_progress, OS.succeeded),
        (OS.claimed, OS.pending),  # the lease expired
        (OS.in_progress, OS.pending),
        (OS.failed, OS.pending),  # operator retry
        (OS.cancelled, OS.pending),
        (OS.pending, OS.cancelled),
    ],
)
def test_operation_moves_on_the_lifecycle(current: OS, target: OS) -> None:
    check_operation_transition(current.value, target)


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (OS.pending, OS.in_progress),  # a controller claims (takes the lease) first
        (OS.pending, OS.succeeded),
        (OS.succeeded, OS.pending),  # success is final, not retried
        (OS.succeeded, OS.failed),
        (OS.failed, OS.succeeded),
        (OS.cancelled, OS.in_progress),
    ],
)
def test_operation_moves_off_the_lifecycle_are_409(current: OS, target: OS) -> None:
    problem = problem_of(check_operation_transition, current.value, target)
    assert (problem.status, problem.code) == (409, "invalid_operation_transition")


# --------------------------------------------------------------------------------------------- placement

PROJECT = uuid.uuid4()
MULTI = {"multi_allocation": True}


def alloc(
    shape: str = "baremetal", gpus: int = 8, status: str = "active", project: uuid.UUID = PROJECT
) -> AllocationView:
    return AllocationView(uuid.uuid4(), project, status, shape, gpus)


def place(
    controller: AllocationView | None,
    workers: Sequence[AllocationView] = (),
    *,
    mode: str = "split",
    compatibility: dict[str, Any] | None = None,
) -> None:
    views = {a.allocation_id: a for a in [*([controller] if controller else []), *workers]}
    check_placement(
        project_id=PROJECT,
        mode=mode,
        controller_allocation_id=controller.allocation_id if controller else None,
        worker_allocation_ids=[w.allocation_id for w in workers],
        allocations=views,
        compatibility=MULTI if compatibility is None else compatibility,
    )


def test_a_controller_and_workers_on_active_allocations_of_the_project_are_placed() -> None:
    place(alloc(), [alloc(), alloc()])
    c = alloc()
    place(c, [c], mode="same_node", compatibility={})


def test_the_controller_allocation_is_required() -> None:
    problem = problem_of(place, None, [alloc()])
    assert (problem.status, problem.code) == (422, "placement_invalid")


def test_a_worker_allocation_is_listed_once() -> None:
    w = alloc()
    assert problem_of(place, alloc(), [w, w]).code == "placement_invalid"


def test_same_node_keeps_every_member_on_the_controller_allocation() -> None:
    assert problem_of(place, alloc(), [alloc()], mode="same_node").code == "placement_invalid"


def test_split_puts_workers_on_other_allocations() -> None:
    c = alloc()
    assert problem_of(place, c, [c], mode="split").code == "placement_invalid"


def test_several_allocations_need_a_multi_allocation_app() -> None:
    problem = problem_of(place, alloc(), [alloc()], compatibility={"multi_allocation": False})
    assert (problem.status, problem.code) == (422, "incompatible_multi_allocation")
    assert problem_of(place, alloc(), [alloc()], compatibility={}).code == "incompatible_multi_allocation"


def test_an_allocation_of_another_project_or_unknown_is_not_in_this_project() -> None:
    stranger = alloc(project=uuid.uuid4())
    problem = problem_of(place, alloc(), [stranger])
    assert (problem.status, problem.code) == (422, "allocation_not_in_project")
    assert problem.extra["allocation_id"] == str(stranger.allocation_id)
    missing = alloc()
    with pytest.raises(Problem) as caught:
        check_placement(
            project_id=PROJECT,
            mode="split",
            controller_allocation_id=missing.allocation_id,
            worker_allocation_ids=[],
            allocations={},
            compatibility=MULTI,
        )
    assert caught.value.code == "allocation_not_in_project"


@pytest.mark.parametrize("status", ["requested", "provisioning", "resizing", "releasing", "released", "failed"])
def test_every_allocation_must_be_active(status: str) -> None:
    worker = alloc(status=status)
    problem = problem_of(place, alloc(), [worker])
    assert (problem.status, problem.code) == (409, "allocation_not_active")
    assert problem.extra["allocation_id"] == str(worker.allocation_id)


def test_the_shape_and_gpus_the_app_needs() -> None:
    baremetal_only = {**MULTI, "requires_capacity_shape": ["baremetal"]}
    problem = problem_of(place, alloc(), [alloc(shape="gpu_slice")], compatibility=baremetal_only)
    assert (problem.status, problem.code) == (422, "incompatible_shape")
    exclusive = {**MULTI, "requires_exclusive_node": True}
    assert problem_of(place, alloc(), [alloc(shape="gpu_slice")], compatibility=exclusive).code == "incompatible_shape"
    place(alloc(), [alloc(shape="gpu_slice")], compatibility={**MULTI, "requires_capacity_shape": []})  # any shape
    four = {**MULTI, "min_gpu_count": 4}
    place(alloc(gpus=4), [alloc(gpus=4)], compatibility=four)
    problem = problem_of(place, alloc(gpus=4), [alloc(gpus=3)], compatibility=four)
    assert (problem.status, problem.code) == (422, "insufficient_gpus")


def test_the_controller_allocation_is_checked_like_the_workers() -> None:
    assert problem_of(place, alloc(status="releasing"), [alloc()]).code == "allocation_not_active"


# ------------------------------------------------------------------------------------------ deploy inputs

INPUTS = {
    "type": "object",
    "properties": {"partition": {"type": "string"}, "nodes": {"type": "integer", "minimum": 1}},
    "required": ["partition"],
    "additionalProperties": False,
}


def test_a_config_matching_the_inputs_is_accepted() -> None:
    validate_config(INPUTS, {"partition": "gpu", "nodes": 2})
    validate_config({"type": "object"}, {})


def test_every_violation_is_listed_with_its_path() -> None:
    problem = problem_of(validate_config, INPUTS, {"nodes": 0, "extra": True})
    assert (problem.status, problem.code) == (422, "invalid_config")
    paths = sorted(tuple(e["path"]) for e in problem.extra["errors"])
    assert paths == [(), (), ("nodes",)]  # missing partition, the unknown field, nodes below its minimum
    assert "nodes:" in problem.detail and "partition" in problem.detail


def test_an_invalid_inputs_schema_is_app_inputs_invalid() -> None:
    problem = problem_of(
        validate_config, {"type": "object", "properties": {"n": {"type": "number", "minimum": "x"}}}, {}
    )
    assert (problem.status, problem.code) == (422, "app_inputs_invalid")


# -------------------------------------------------------------------------------------------- member roles


def test_component_keys_are_the_first_two_roles_or_controller_and_worker() -> None:
    assert component_keys([]) == ("controller", "worker")
    assert component_keys([{"key": "head"}]) == ("head", "head")  # one role: every member has it
    assert component_keys([{"key": "ctld"}, {"key": "node"}, {"key": "login"}]) == ("ctld", "node")
    assert component_keys([{"key": ""}, {"display_name": "x"}]) == ("controller", "worker")


ROLES = [{"key": "ctld"}, {"key": "node"}, {"key": "login"}]


def test_add_names_one_of_the_manifests_roles() -> None:
    check_add_component(ROLES, "node", ["ctld", "node"])
    check_add_component(ROLES, "login", ["ctld"])
    problem = problem_of(check_add_component, ROLES, "worker", [])
    assert (problem.status, problem.code) == (422, "unknown_component_key")
    assert problem.extra["roles"] == ["ctld", "node", "login"]


def test_add_never_brings_a_second_controller() -> None:
    problem = problem_of(check_add_component, ROLES, "ctld", ["ctld", "node"])
    assert (problem.status, problem.code) == (409, "controller_member_exists")
    check_add_component(ROLES, "ctld", ["node"])  # the controller is gone: adding one is how it comes back


def test_without_roles_the_default_controller_and_worker_apply() -> None:
    check_add_component([], "worker", ["controller", "worker"])
    assert problem_of(check_add_component, [], "controller", ["controller"]).code == "controller_member_exists"
    assert problem_of(check_add_component, [], "ctld", []).code == "unknown_component_key"


def test_a_single_role_app_adds_members_of_that_role_freely() -> None:
    check_add_component([{"key": "replica"}], "replica", ["replica", "replica"])


# ---------------------------------------------------------------------------------------- derived status


@pytest.mark.parametrize(
    ("current", "members", "derived"),
    [
        (IS.created, [], IS.created),
        (IS.created, [MS.pending], IS.starting),
        (IS.created, [MS.active, MS.starting], IS.starting),
        (IS.starting, [MS.active, MS.active], IS.running),
        (IS.running, [MS.active, MS.failed], IS.degraded),  # one failed member degrades the instance
        (IS.degraded, [MS.active, MS.active], IS.running),  # and its recovery restores it
        (IS.running, [MS.active, MS.starting], IS.running),  # a member being added does not demote a running instance
        (IS.degraded, [MS.active, MS.starting], IS.degraded),
        (IS.failed, [MS.starting], IS.failed),
        (IS.failed, [MS.active], IS.running),  # every member came back
        (IS.running, [MS.draining], IS.degraded),  # nothing left serving
        (IS.running, [], IS.degraded),
        (IS.starting, [MS.removed], IS.starting),
    ],
)
def test_a_live_instance_status_follows_its_members(current: IS, members: list[MS], derived: IS) -> None:
    assert derive_instance_status(current.value, [m.value for m in members]) is derived


def test_a_member_removed_on_request_is_no_loss() -> None:
    assert derive_instance_status("running", ["active", "stopping"]) is IS.running
    assert derive_instance_status("running", ["failed", "stopping"]) is IS.degraded
    # every member leaving by plan: judged by those leaving (no member stays to judge by)
    assert derive_instance_status("running", ["stopping"]) is IS.degraded


@pytest.mark.parametrize(
    "current", [IS.stopping, IS.stopped, IS.decommissioning, IS.decommissioned, IS.decommission_failed]
)
def test_statuses_set_by_an_operator_request_are_not_derived(current: IS) -> None:
    assert derive_instance_status(current.value, ["active", "active"]) is current
    assert derive_instance_status(current.value, ["failed"]) is current


# ----------------------------------------------------------------------------------------------- versions


def test_versions_order_naturally_with_a_release_after_its_pre_releases() -> None:
    labels = ["1.9", "1.10", "1.9-rc1", "0.9.1", "2.0", "1.9.1", "1.9-rc10", "1.9-rc2", "1.9-beta"]
    assert sorted(labels, key=version_key) == [
        "0.9.1",
        "1.9-beta",
        "1.9-rc1",
        "1.9-rc2",
        "1.9-rc10",
        "1.9",
        "1.9.1",
        "1.10",
        "2.0",
    ]
    assert max(["1.2.0", "1.2.0-rc.1"], key=version_key) == "1.2.0"  # what a deploy without a version picks
    assert version_key("1.2.3+build.7") == version_key("1.2.3")  # build metadata does not order
    assert version_key("22.05") > version_key("21.08")


# --------------------------------------------------------------------------------------- controller state


def test_a_write_at_the_stored_version_gets_the_next_one() -> None:
    assert check_controller_state_write(0, 0, 10) == 1  # the first write: nothing stored yet
    assert check_controller_state_write(7, 7, CONTROLLER_STATE_MAX_BYTES) == 8  # the limit itself is allowed


def test_a_write_behind_or_ahead_of_the_stored_version_is_409() -> None:
    for expected in (6, 8, 0):
        problem = problem_of(check_controller_state_write, 7, expected, 10)
        assert (problem.status, problem.code) == (409, "state_version_conflict")


def test_controller_state_stays_small() -> None:
    problem = problem_of(check_controller_state_write, 1, 1, CONTROLLER_STATE_MAX_BYTES + 1)
    assert (problem.status, problem.code) == (422, "controller_state_too_large")
    # the size is refused before the version is looked at: a retry with the right version cannot pass
    assert problem_of(check_controller_state_write, 1, 0, CONTROLLER_STATE_MAX_BYTES + 1).code == (
        "controller_state_too_large"
    )
