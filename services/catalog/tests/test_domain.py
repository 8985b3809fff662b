"""Catalog rules without I/O (gpuaas.catalog.domain): the artifact lifecycle and its gates, manifest validation,
an app's compatibility with an allocation, and which manifest a tenant is offered."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from gpuaas.catalog.domain import (
    AllocationShape,
    artifact_kind_for,
    check_transition,
    compatibility_reasons,
    offered_to,
    validate_manifest,
)
from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events.catalog import AppArtifactKind, ArtifactKind, ArtifactLifecycle
from gpuaas.kit.problems import Problem

L = ArtifactLifecycle
REF = "registry.example:5000/apps/vllm@sha256:" + "a" * 64
PASSED = [{"name": "lint", "passed": True}, {"name": "smoke", "passed": True}]


def manifest(**fields: Any) -> dict[str, Any]:
    return {
        "slug": "vllm",
        "display_name": "vLLM",
        "version": "1.2.3",
        "artifact_kind": "oci",
        "artifact_ref": REF,
        **fields,
    }


def refused(doc: Any) -> Problem:
    with pytest.raises(Problem) as caught:
        validate_manifest(doc)
    assert caught.value.status == 422
    return caught.value


def move(current: ArtifactLifecycle, target: ArtifactLifecycle, **gates: Any) -> None:
    values: dict[str, Any] = {"checks": PASSED, "canary_tenants": [uuid.uuid4()], "instances_using": 0} | gates
    check_transition(current, target, **values)


# ----------------------------------------------------------------------------------------------- lifecycle


def test_the_whole_lifecycle_is_allowed_with_its_gates_met_and_a_canary_can_roll_back() -> None:
    for current, target in [(L.draft, L.staged), (L.staged, L.canary), (L.canary, L.active)]:
        move(current, target)
    move(L.active, L.deprecated)
    move(L.deprecated, L.retired)
    move(L.canary, L.staged)  # the rollback


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (L.draft, L.active),  # no skipping the staging checks and the canary
        (L.draft, L.canary),
        (L.staged, L.active),
        (L.active, L.staged),
        (L.active, L.retired),  # deprecated first: existing instances get a warning period
        (L.deprecated, L.active),
        (L.retired, L.draft),
        (L.retired, L.active),
        (L.draft, L.draft),
    ],
)
def test_moves_outside_the_table_are_409_transition_not_allowed(current: L, target: L) -> None:
    with pytest.raises(Problem) as caught:
        move(current, target)
    assert (caught.value.status, caught.value.code) == (409, "transition_not_allowed")
    assert current.value in caught.value.detail and target.value in caught.value.detail


def test_a_retired_artifact_is_terminal() -> None:
    for target in L:
        with pytest.raises(Problem, match="none \\(terminal\\)"):
            move(L.retired, target)


@pytest.mark.parametrize(
    ("checks", "missing"),
    [
        ([], ["lint", "smoke"]),
        ([{"name": "lint", "passed": True}], ["smoke"]),
        ([{"name": "lint", "passed": True}, {"name": "smoke", "passed": False}], ["smoke"]),
        # the latest result of a check counts: a pass followed by a failure is a failure
        ([*PASSED, {"name": "lint", "passed": False}], ["lint"]),
    ],
)
def test_staging_needs_the_latest_lint_and_smoke_results_to_pass(
    checks: list[dict[str, Any]], missing: list[str]
) -> None:
    with pytest.raises(Problem) as caught:
        move(L.draft, L.staged, checks=checks)
    assert (caught.value.status, caught.value.code) == (409, "artifact_checks_missing")
    assert caught.value.extra["missing"] == missing


def test_a_failed_check_passed_again_later_allows_staging() -> None:
    move(L.draft, L.staged, checks=[{"name": "smoke", "passed": False}, {"name": "lint", "passed": True}, *PASSED[1:]])


def test_the_checks_gate_only_the_move_out_of_draft() -> None:
    move(L.canary, L.staged, checks=[])  # a rollback needs no new checks


def test_a_canary_needs_a_tenant_to_expose_it_to() -> None:
    with pytest.raises(Problem) as caught:
        move(L.staged, L.canary, canary_tenants=[])
    assert (caught.value.status, caught.value.code) == (409, "canary_tenants_required")


def test_retire_is_refused_while_an_instance_uses_the_digest() -> None:
    with pytest.raises(Problem) as caught:
        move(L.deprecated, L.retired, instances_using=2)
    assert (caught.value.status, caught.value.code) == (409, "artifact_in_use")
    assert caught.value.extra["instances"] == 2
    move(L.active, L.deprecated, instances_using=2)  # deprecating does not wait for them


# ---------------------------------------------------------------------------------------- manifests


def test_a_minimal_manifest_is_filled_with_defaults() -> None:
    m = validate_manifest(manifest())
    assert m["compatibility"] == {
        "requires_capacity_shape": ["baremetal", "gpu_slice"],
        "min_gpu_count": 1,
        "requires_exclusive_node": False,
        "multi_allocation": False,
    }
    assert m["active"] is False  # a new manifest is offered only once activated
    assert (m["description"], m["runtime_version"], m["roles"], m["runtime_profile"]) == ("", None, [], None)
    assert m["inputs"] == {"type": "object", "properties": {}}


def test_the_given_compatibility_overrides_only_what_it_names() -> None:
    m = validate_manifest(manifest(compatibility={"min_gpu_count": 4, "multi_allocation": True}))
    assert m["compatibility"]["min_gpu_count"] == 4 and m["compatibility"]["multi_allocation"] is True
    assert m["compatibility"]["requires_capacity_shape"] == ["baremetal", "gpu_slice"]


def test_the_input_document_is_not_modified() -> None:
    doc = manifest()
    validate_manifest(doc)
    assert doc == manifest()


@pytest.mark.parametrize("missing", ["slug", "display_name", "version", "artifact_kind", "artifact_ref"])
def test_a_missing_required_field_is_manifest_invalid(missing: str) -> None:
    doc = manifest()
    del doc[missing]
    problem = refused(doc)
    assert problem.code == "manifest_invalid"
    assert any(missing in e["message"] for e in problem.extra["errors"])


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"slug": "vLLM"}, "slug"),
        ({"slug": "-vllm"}, "slug"),
        ({"slug": "vllm-"}, "slug"),
        ({"slug": "a" * 65}, "slug"),
        ({"version": "1.2"}, "version"),
        ({"version": "01.2.3"}, "version"),
        ({"version": "v1.2.3"}, "version"),
        ({"artifact_kind": "helm"}, "artifact_kind"),
        ({"artifact_ref": ""}, "artifact_ref"),
        ({"display_name": ""}, "display_name"),
        ({"compatibility": {"requires_capacity_shape": ["vm"]}}, "compatibility/requires_capacity_shape/0"),
        ({"compatibility": {"requires_capacity_shape": []}}, "compatibility/requires_capacity_shape"),
        ({"compatibility": {"min_gpu_count": 65}}, "compatibility/min_gpu_count"),
        ({"compatibility": {"gpus": 1}}, "compatibility"),
        ({"roles": [{"key": "Controller"}]}, "roles/0/key"),
        ({"price": 3}, ""),  # no unknown fields
    ],
)
def test_schema_violations_name_the_path(fields: dict[str, Any], path: str) -> None:
    problem = refused(manifest(**fields))
    assert problem.code == "manifest_invalid"
    assert path in [e["path"] for e in problem.extra["errors"]]


def test_not_an_object_is_manifest_invalid() -> None:
    assert refused(["slug", "vllm"]).code == "manifest_invalid"


@pytest.mark.parametrize("slug", ["a", "vllm", "slurm-22-05", "a" * 64])
def test_slugs_accepted(slug: str) -> None:
    assert validate_manifest(manifest(slug=slug))["slug"] == slug


@pytest.mark.parametrize("version", ["0.0.0", "1.10.0", "2.0.0-rc.1", "1.2.3+build.7", "1.2.3-beta+exp.sha.5114f85"])
def test_semver_versions_accepted(version: str) -> None:
    assert validate_manifest(manifest(version=version))["version"] == version


@pytest.mark.parametrize(
    "inputs",
    [
        {"type": "array"},  # config is a JSON object
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": "one"}}},  # not a valid schema
        {"type": 12},
    ],
)
def test_inputs_must_be_a_valid_schema_of_an_object(inputs: dict[str, Any]) -> None:
    assert refused(manifest(inputs=inputs)).code == "inputs_schema_invalid"


def test_inputs_with_properties_are_kept() -> None:
    inputs = {"type": "object", "properties": {"partition": {"type": "string"}}, "required": ["partition"]}
    assert validate_manifest(manifest(inputs=inputs))["inputs"] == inputs


def test_role_keys_are_unique() -> None:
    roles = [{"key": "controller"}, {"key": "worker"}, {"key": "controller"}]
    assert refused(manifest(artifact_kind="controller", roles=roles)).code == "roles_invalid"


def test_a_controller_app_declares_its_member_roles() -> None:
    assert refused(manifest(artifact_kind="controller")).code == "roles_required"
    m = validate_manifest(manifest(artifact_kind="controller", roles=[{"key": "controller"}, {"key": "worker"}]))
    assert [r["key"] for r in m["roles"]] == ["controller", "worker"]


def test_roles_may_come_after_other_roles_without_a_cycle() -> None:
    def roles(**after: list[str]) -> list[dict[str, Any]]:
        return [{"key": k, "after": a} for k, a in after.items()]

    m = validate_manifest(manifest(artifact_kind="controller", roles=roles(head=[], worker=["head"], ui=["worker"])))
    assert [r.get("after") for r in m["roles"]] == [[], ["head"], ["worker"]]
    assert refused(manifest(artifact_kind="controller", roles=roles(head=[], worker=["nope"]))).code == "roles_invalid"
    assert refused(manifest(artifact_kind="controller", roles=roles(head=["head"]))).code == "roles_invalid"
    cycle = roles(head=["ui"], worker=["head"], ui=["worker"])
    problem = refused(manifest(artifact_kind="controller", roles=cycle))
    assert problem.code == "roles_invalid" and "cycle" in problem.detail


def profile(**fields: Any) -> dict[str, Any]:
    return {"image": REF, "ports": [{"name": "http", "container_port": 8000, "http": True}], **fields}


def test_a_launchable_app_needs_a_runtime_profile() -> None:
    assert refused(manifest(artifact_kind="launchable")).code == "runtime_profile_required"
    m = validate_manifest(manifest(artifact_kind="launchable", runtime_profile=profile()))
    assert m["runtime_profile"]["image"] == REF


def test_an_oci_app_may_carry_a_profile_but_other_kinds_may_not() -> None:
    validate_manifest(manifest(runtime_profile=profile()))
    for kind in ("blob", "runtime"):
        assert refused(manifest(artifact_kind=kind, runtime_profile=profile())).code == "runtime_profile_not_applicable"
    roles = [{"key": "controller"}]
    problem = refused(manifest(artifact_kind="controller", roles=roles, runtime_profile=profile()))
    assert problem.code == "runtime_profile_not_applicable"


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"workdir": "relative/dir"}, "runtime_profile/workdir"),
        ({"env": {"1BAD": "x"}}, "runtime_profile/env"),
        ({"ports": [{"name": "http", "container_port": 0}]}, "runtime_profile/ports/0/container_port"),
        ({"ports": [{"name": "http", "container_port": 65536}]}, "runtime_profile/ports/0/container_port"),
        ({"ports": [{"name": "http", "container_port": 80, "protocol": "sctp"}]}, "runtime_profile/ports/0/protocol"),
        ({"volumes": [{"name": "data", "mount_path": "data"}]}, "runtime_profile/volumes/0/mount_path"),
        ({"auth": {"header": "Authorization"}}, "runtime_profile/auth"),  # auth names the env its secret is read from
        ({"privileged": True}, "runtime_profile/"),  # nothing outside the profile schema (its root)
        ({"resources": {"gpu_count": -1}}, "runtime_profile/resources/gpu_count"),
    ],
)
def test_profile_violations_are_runtime_profile_invalid_with_their_path(fields: dict[str, Any], path: str) -> None:
    problem = refused(manifest(artifact_kind="launchable", runtime_profile=profile(**fields)))
    assert problem.code == "runtime_profile_invalid"
    assert path in [e["path"] for e in problem.extra["errors"]]


def test_the_profile_runs_the_manifests_own_digest() -> None:
    other = "registry.example:5000/apps/vllm@sha256:" + "b" * 64
    problem = refused(manifest(artifact_kind="launchable", runtime_profile=profile(image=other)))
    assert problem.code == "runtime_profile_invalid"
    assert "artifact_ref" in problem.detail


def test_the_profile_asks_for_no_more_gpus_than_the_app_guarantees() -> None:
    launchable = {"artifact_kind": "launchable", "compatibility": {"min_gpu_count": 2}}
    validate_manifest(manifest(**launchable, runtime_profile=profile(resources={"gpu_count": 2})))
    validate_manifest(manifest(**launchable, runtime_profile=profile(resources={"gpu_count": 0})))
    problem = refused(manifest(**launchable, runtime_profile=profile(resources={"gpu_count": 3})))
    assert problem.code == "runtime_profile_inconsistent"
    # without compatibility, the default guarantee is one GPU
    problem = refused(manifest(artifact_kind="launchable", runtime_profile=profile(resources={"gpu_count": 2})))
    assert problem.code == "runtime_profile_inconsistent"


def test_only_blob_apps_are_stored_as_blobs() -> None:
    assert artifact_kind_for(AppArtifactKind.blob) is ArtifactKind.blob
    for kind in set(AppArtifactKind) - {AppArtifactKind.blob}:
        assert artifact_kind_for(kind) is ArtifactKind.oci


# ------------------------------------------------------------------------------------ compatibility

DEFAULT_COMPAT = validate_manifest(manifest())["compatibility"]


def codes(compat: dict[str, Any], shape: AllocationShape) -> list[str]:
    return [r["code"] for r in compatibility_reasons(compat, shape)]


def test_a_default_app_fits_any_allocation_with_a_gpu() -> None:
    assert codes(DEFAULT_COMPAT, AllocationShape(CapacityShape.gpu_slice, 1)) == []
    assert codes(DEFAULT_COMPAT, AllocationShape(CapacityShape.baremetal, 8)) == []
    assert codes(DEFAULT_COMPAT, AllocationShape(CapacityShape.gpu_slice, 0)) == ["insufficient_gpus"]


def test_the_shape_the_app_runs_on() -> None:
    compat = {**DEFAULT_COMPAT, "requires_capacity_shape": ["baremetal"]}
    assert codes(compat, AllocationShape(CapacityShape.gpu_slice, 8)) == ["capacity_shape_unsupported"]
    assert codes(compat, AllocationShape(CapacityShape.baremetal, 8)) == []


def test_min_gpu_count_is_inclusive() -> None:
    compat = {**DEFAULT_COMPAT, "min_gpu_count": 4}
    assert codes(compat, AllocationShape(CapacityShape.gpu_slice, 4)) == []
    reasons = compatibility_reasons(compat, AllocationShape(CapacityShape.gpu_slice, 3))
    assert [r["code"] for r in reasons] == ["insufficient_gpus"]
    assert "4" in reasons[0]["message"] and "3" in reasons[0]["message"]


def test_an_exclusive_node_is_baremetal_or_a_slice_held_exclusively() -> None:
    compat = {**DEFAULT_COMPAT, "requires_exclusive_node": True}
    assert codes(compat, AllocationShape(CapacityShape.gpu_slice, 2)) == ["exclusive_node_required"]
    assert codes(compat, AllocationShape(CapacityShape.gpu_slice, 2, exclusive_node=True)) == []
    assert codes(compat, AllocationShape(CapacityShape.baremetal, 2)) == []


def test_several_allocations_need_a_multi_allocation_app() -> None:
    assert codes(DEFAULT_COMPAT, AllocationShape(CapacityShape.baremetal, 8, allocation_count=2)) == [
        "multi_allocation_unsupported"
    ]
    multi = {**DEFAULT_COMPAT, "multi_allocation": True}
    assert codes(multi, AllocationShape(CapacityShape.baremetal, 8, allocation_count=2)) == []


def test_every_unmet_requirement_is_reported_not_just_the_first() -> None:
    compat = {
        "requires_capacity_shape": ["baremetal"],
        "min_gpu_count": 8,
        "requires_exclusive_node": True,
        "multi_allocation": False,
    }
    shape = AllocationShape(CapacityShape.gpu_slice, 1, allocation_count=3)
    assert codes(compat, shape) == [
        "capacity_shape_unsupported",
        "insufficient_gpus",
        "exclusive_node_required",
        "multi_allocation_unsupported",
    ]


# --------------------------------------------------------------------------------------- offering


def test_an_active_manifest_of_an_active_artifact_is_offered_to_every_tenant() -> None:
    m, a = {"deprecated": False, "active": True}, {"state": "active", "canary_tenants": []}
    assert offered_to(m, a, uuid.uuid4()) is None


def test_a_deprecated_manifest_is_offered_to_nobody() -> None:
    tenant = uuid.uuid4()
    m = {"deprecated": True, "active": True}
    assert offered_to(m, {"state": "active", "canary_tenants": []}, tenant) == "manifest_deprecated"
    assert offered_to(m, {"state": "canary", "canary_tenants": [tenant]}, tenant) == "manifest_deprecated"


def test_a_canary_is_offered_to_its_tenants_only() -> None:
    tenant, other = uuid.uuid4(), uuid.uuid4()
    m = {"deprecated": False, "active": False}
    a = {"state": "canary", "canary_tenants": [str(tenant)]}  # stored as text, compared with a UUID
    assert offered_to(m, a, tenant) is None
    assert offered_to(m, a, other) == "manifest_not_active"


@pytest.mark.parametrize("state", ["draft", "staged", "deprecated", "retired"])
def test_an_active_manifest_is_not_offered_while_its_artifact_is_not_active(state: str) -> None:
    m = {"deprecated": False, "active": True}
    assert offered_to(m, {"state": state, "canary_tenants": []}, uuid.uuid4()) == "manifest_not_active"


def test_an_inactive_manifest_is_not_offered() -> None:
    m = {"deprecated": False, "active": False}
    assert offered_to(m, {"state": "active", "canary_tenants": []}, uuid.uuid4()) == "manifest_not_active"
