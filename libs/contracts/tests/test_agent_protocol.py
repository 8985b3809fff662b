"""The control plane ⇄ node agent protocol (`gpuaas.contracts.agent`): one version behind keeps working both
ways, malformed parts of a result are dropped rather than refusing the report, and a breaking change to the
exported schemas is caught."""

from __future__ import annotations

import copy
import json
import typing
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from gpuaas.contracts import agent, schema_files
from gpuaas.contracts.compat import breaking, compare_files

SAMPLES = json.loads((Path(__file__).parent / "samples" / "protocol-v0.json").read_text())
SCHEMA_DIR = Path(__file__).resolve().parents[1] / "schemas"


def with_unknown_fields(doc: Any) -> Any:
    """`doc` with a field a newer peer might add in every object, nested ones included (not in free-form maps:
    a workload's environment, the agent's reconcile report)."""
    if isinstance(doc, dict):
        fields = {k: v if k in ("env", "reconciled") else with_unknown_fields(v) for k, v in doc.items()}
        return {**fields, "added_in_a_later_version": {"x": [1]}}
    if isinstance(doc, list):
        return [with_unknown_fields(v) for v in doc]
    return doc


# --- one version behind: what the landed (untyped) code sent still validates -----------------------------


@pytest.mark.parametrize("name", sorted(SAMPLES["tasks"]))
def test_an_older_control_planes_payloads_parse(name: str) -> None:
    kind = name.removesuffix("_process_host")
    raw = SAMPLES["tasks"][name]

    task = agent.parse_task(kind, raw)

    assert task.kind == kind and str(task.allocation_id) == raw["allocation_id"]
    # what the agent reads is what was sent (nothing lost in the typing)
    dumped = task.model_dump(mode="json")
    assert {k: dumped[k] for k in raw} == raw


@pytest.mark.parametrize("name", sorted(SAMPLES["results"]))
def test_an_older_agents_results_validate(name: str) -> None:
    kind = {"sync_ssh_keys_skipped": "sync_ssh_keys", "failed": "provision"}.get(name, name)
    raw = SAMPLES["results"][name]

    result = agent.parse_result(kind, raw)

    assert result.kind == kind
    assert result.model_dump(mode="json", exclude_unset=True) == {**raw, "kind": kind}


def test_an_older_agents_bodies_validate() -> None:
    registration = agent.AgentRegistration.model_validate(SAMPLES["registration"])
    assert registration.gpus[0].model == "H100-80GB" and registration.reconciled is not None
    assert agent.AgentRegistered.model_validate(SAMPLES["registered"]).heartbeat_interval_s == 10.0
    assert agent.HeartbeatAck.model_validate(SAMPLES["heartbeat"]).status == "ready"
    assert agent.TaskProgress.model_validate(SAMPLES["progress"]).phase == "workspace"
    completion = agent.TaskCompletion.model_validate(SAMPLES["completion"])
    assert agent.parse_result("provision", completion.result).network is not None


def test_a_lease_from_an_older_control_plane_takes_its_kind_into_the_payload() -> None:
    lease = agent.TaskLease.model_validate(SAMPLES["lease"])

    assert isinstance(lease.payload, agent.ProvisionTask)
    assert lease.payload.workload is not None and lease.payload.workload.port == 8888
    assert lease.model_dump(mode="json")["payload"]["kind"] == "provision"


def test_a_lease_whose_payload_contradicts_its_kind_is_refused() -> None:
    raw = {**SAMPLES["lease"], "payload": {**SAMPLES["lease"]["payload"], "kind": "release"}}
    with pytest.raises(ValidationError, match="is not its payload's"):
        agent.TaskLease.model_validate(raw)


# --- one version ahead: unknown fields from a newer peer are ignored -------------------------------------


@pytest.mark.parametrize("name", sorted(SAMPLES["tasks"]))
def test_the_agent_ignores_fields_a_newer_control_plane_adds(name: str) -> None:
    kind = name.removesuffix("_process_host")
    plain = agent.parse_task(kind, SAMPLES["tasks"][name])

    newer = agent.parse_task(kind, with_unknown_fields(SAMPLES["tasks"][name]))

    assert newer == plain


def test_a_lease_and_the_registration_answer_with_unknown_fields_parse() -> None:
    lease = agent.TaskLease.model_validate(with_unknown_fields(SAMPLES["lease"]))
    assert lease == agent.TaskLease.model_validate(SAMPLES["lease"])
    registered = agent.AgentRegistered.model_validate(with_unknown_fields(SAMPLES["registered"]))
    assert registered.name == "gpu-1"


@pytest.mark.parametrize("name", ["provision", "resize", "sync_ssh_keys", "attach_volume"])
def test_the_service_ignores_fields_a_newer_agent_adds(name: str) -> None:
    plain = agent.parse_result(name, SAMPLES["results"][name])
    assert agent.parse_result(name, with_unknown_fields(SAMPLES["results"][name])) == plain
    body = agent.AgentRegistration.model_validate(with_unknown_fields(SAMPLES["registration"]))
    assert body.ssh_port == 2222


def test_release_evidence_keeps_a_check_a_newer_agent_adds() -> None:
    raw = copy.deepcopy(SAMPLES["results"]["release"])
    raw["evidence"]["gpu_memory_cleared"] = False

    result = agent.parse_result("release", raw)

    assert isinstance(result, agent.ReleaseResult) and result.evidence is not None
    assert result.evidence.model_dump(exclude_unset=True)["gpu_memory_cleared"] is False
    assert "gpu_memory_cleared=NO" in result.evidence.summary()


def test_a_kind_this_version_does_not_know_is_refused_by_its_reason() -> None:
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        agent.parse_task("migrate", {"allocation_id": str(uuid.uuid4())})


# --- malformed parts of a result are dropped, not the whole report ---------------------------------------


@pytest.mark.parametrize(
    ("network", "expected"),
    [
        ({"name": "bad name; rm -rf /", "address": "10.0.0.1"}, None),
        ({"name": "net", "address": "not-an-ip", "hostname": "ok-host"}, {"address": None, "hostname": "ok-host"}),
        ({"name": "net", "address": "10.0.0.1", "hostname": "bad host"}, {"address": "10.0.0.1", "hostname": None}),
        ("a string", None),
    ],
)
def test_a_malformed_network_part_is_dropped(network: Any, expected: dict[str, Any] | None) -> None:
    result = agent.parse_result("restart", {"network": network})

    assert isinstance(result, agent.RestartResult) and "network" in result.model_fields_set
    if expected is None:
        assert result.network is None
    else:
        assert result.network is not None
        assert {k: v for k, v in result.network.model_dump(mode="json").items() if k in expected} == expected


@pytest.mark.parametrize("report", [{"host_port": 0}, {"host_port": 70000}, {"host_port": "x"}, []])
def test_a_malformed_workload_report_is_dropped(report: Any) -> None:
    result = agent.parse_result("provision", {"ssh_port": 2222, "workload": report})
    assert isinstance(result, agent.ProvisionResult) and result.workload is None and result.ssh_port == 2222


def test_a_result_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ValidationError):
        agent.parse_result("resize", {"gpu_indices": "all of them"})


# --- the union, the tables, the schemas -----------------------------------------------------------------


def test_every_task_kind_has_a_result_kind_and_the_unions_hold_exactly_the_listed_types() -> None:
    task_members = typing.get_args(typing.get_args(agent.AgentTask)[0])
    result_members = typing.get_args(typing.get_args(agent.AgentResult)[0])
    assert set(task_members) == set(agent.TASK_TYPES)
    assert set(result_members) == set(agent.RESULT_TYPES)
    assert sorted(map(agent.kind_of, agent.TASK_TYPES)) == sorted(map(agent.kind_of, agent.RESULT_TYPES))
    assert sorted(map(agent.kind_of, agent.TASK_TYPES)) == sorted(typing.get_args(agent.TaskKind))


def test_complete_table_names_what_is_missing() -> None:
    table: dict[type[BaseModel], object] = {t: None for t in agent.TASK_TYPES[1:]}
    with pytest.raises(TypeError, match="no handler for \\['ProvisionTask'\\]"):
        agent.complete_table(table, agent.TASK_TYPES, "test")
    agent.complete_table({t: None for t in agent.TASK_TYPES}, agent.TASK_TYPES, "test")


def test_the_published_schemas_accept_what_an_older_peer_sends() -> None:
    """A consumer in another language validating with the committed JSON Schemas accepts the old shapes."""
    jsonschema = pytest.importorskip("jsonschema")

    def check(path: str, doc: Any) -> None:
        schema = json.loads((SCHEMA_DIR / path).read_text())
        jsonschema.validate(doc, schema, format_checker=jsonschema.FormatChecker())

    for name, raw in SAMPLES["tasks"].items():
        check(f"agent/tasks/{name.removesuffix('_process_host')}.json", raw)
    for name, raw in SAMPLES["results"].items():
        kind = {"sync_ssh_keys_skipped": "sync_ssh_keys", "failed": "provision"}.get(name, name)
        check(f"agent/results/{kind}.json", raw)
    check("agent/AgentRegistration.json", SAMPLES["registration"])
    check("agent/TaskLease.json", {**SAMPLES["lease"], "payload": {**SAMPLES["lease"]["payload"], "kind": "provision"}})
    check("agent/TaskCompletion.json", SAMPLES["completion"])


@pytest.fixture(scope="module")
def generated() -> dict[str, dict[str, Any]]:
    return {p: d for p, d in schema_files.generate().items() if p.startswith("agent/")}


def test_the_protocol_is_exported_one_file_per_body_task_and_result(generated: dict[str, dict[str, Any]]) -> None:
    kinds = sorted(map(agent.kind_of, agent.TASK_TYPES))
    expected = {f"agent/{name}.json" for name in agent.MESSAGES}
    expected |= {f"agent/tasks/{k}.json" for k in kinds} | {f"agent/results/{k}.json" for k in kinds}
    expected |= {"agent/tasks.json", "agent/results.json"}
    assert set(generated) == expected
    assert generated["agent/tasks.json"]["x-gpuaas"]["kinds"] == kinds
    assert generated["agent/tasks.json"]["discriminator"]["propertyName"] == "kind"


def _breaks(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> set[tuple[str, str]]:
    return {(c.where, c.message) for c in breaking(compare_files(old, new))}


def test_removing_a_field_is_breaking(generated: dict[str, dict[str, Any]]) -> None:
    new = copy.deepcopy(generated)
    del new["agent/tasks/provision.json"]["properties"]["authorized_keys"]

    assert ("agent/tasks/provision.json: authorized_keys", "field removed") in _breaks(generated, new)


def test_making_an_optional_field_required_is_breaking(generated: dict[str, dict[str, Any]]) -> None:
    """E.g. the service requiring `network` in a result: an older agent that never sends it would be refused."""
    new = copy.deepcopy(generated)
    new["agent/results/restart.json"].setdefault("required", []).append("network")

    assert ("agent/results/restart.json: network", "optional field became required") in _breaks(generated, new)


def test_narrowing_a_type_is_breaking(generated: dict[str, dict[str, Any]]) -> None:
    new = copy.deepcopy(generated)
    new["agent/AgentRegistration.json"]["properties"]["ssh_host"]["maxLength"] = 63
    new["agent/TaskProgress.json"]["properties"]["status"]["enum"].remove("info")

    found = _breaks(generated, new)

    assert ("agent/AgentRegistration.json: ssh_host", "constraint 'maxLength' changed from 255 to 63") in found
    assert ("agent/TaskProgress.json: status", "enum value 'info' removed") in found


def test_removing_a_kind_is_breaking_and_adding_one_is_not(generated: dict[str, dict[str, Any]]) -> None:
    fewer = copy.deepcopy(generated)
    fewer["agent/tasks.json"]["x-gpuaas"]["kinds"].remove("resize")
    del fewer["agent/tasks/resize.json"]

    found = _breaks(generated, fewer)

    assert ("agent/tasks.json", "kind 'resize' removed") in found
    assert ("agent/tasks/resize.json", "agent protocol message removed") in found
    assert _breaks(fewer, generated) == set()


def test_a_new_optional_field_is_compatible(generated: dict[str, dict[str, Any]]) -> None:
    new = copy.deepcopy(generated)
    new["agent/tasks/provision.json"]["properties"]["priority"] = {"type": "integer", "default": 0}

    assert _breaks(generated, new) == set()


def test_the_release_baseline_holds_the_protocol(generated: dict[str, dict[str, Any]]) -> None:
    baseline = schema_files.load_baseline(Path(__file__).resolve().parents[1] / "baseline")
    assert baseline is not None
    released = {p: d for p, d in baseline.files.items() if p.startswith("agent/")}
    # A kind added since the release brings its task and result files (additive, like the kind itself);
    # any other file the baseline lacks means it must be cut.
    kinds = set(released["agent/tasks.json"]["x-gpuaas"]["kinds"])
    unreleased = {p for p in set(generated) - set(released) if not _new_kind_file(p, kinds)}
    assert set(released) <= set(generated) and not unreleased, f"the protocol's baseline lacks {unreleased} (cut it)"
    assert _breaks(released, generated) == set()


def _new_kind_file(path: str, released_kinds: set[str]) -> bool:
    parts = path.split("/")
    return len(parts) == 3 and parts[1] in ("tasks", "results") and Path(parts[2]).stem not in released_kinds


def test_a_message_whose_kind_contradicts_its_task_is_refused() -> None:
    with pytest.raises(agent.KindMismatch, match="'provision' task's message says kind 'release'"):
        agent.parse_result("provision", {"kind": "release"})
    with pytest.raises(ValueError, match="says kind 'restart'"):
        agent.parse_task("provision", {**SAMPLES["tasks"]["restart"], "kind": "restart"})
