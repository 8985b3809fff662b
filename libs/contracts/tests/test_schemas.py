"""The committed schemas: up to date, backward compatible with them and with the release baseline, and the
export command itself."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpuaas.contracts import schema_files
from gpuaas.contracts.compat import breaking, compare_files, format_changes
from gpuaas.contracts.registry import EVENT_TYPES, TOPICS
from gpuaas.contracts.schemas_export import main as export

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "schemas"
BASELINE_DIR = Path(__file__).resolve().parents[1] / "baseline"
EXPORT = "uv run python -m gpuaas.contracts.schemas_export"
# A field every allocation event carries since the first release: removing it must break.
RELEASED_EVENT = "events/gpuaas.allocations.v1/allocation.activated.json"


@pytest.fixture(scope="module")
def generated() -> dict[str, dict[str, Any]]:
    return schema_files.generate()


def test_committed_schemas_are_up_to_date(generated: dict[str, dict[str, Any]]) -> None:
    committed = {p.relative_to(SCHEMA_DIR).as_posix() for p in SCHEMA_DIR.rglob("*.json")}
    missing = sorted(generated.keys() - committed)
    extra = sorted(committed - generated.keys())
    changed = sorted(
        path
        for path in generated.keys() & committed
        if (SCHEMA_DIR / path).read_text(encoding="utf-8") != schema_files.dumps(generated[path])
    )
    assert not (missing or extra or changed), (
        f"schemas in {SCHEMA_DIR} are stale (missing={missing}, extra={extra}, changed={changed}); "
        f"run `{EXPORT}` and commit the result"
    )


def test_code_is_backward_compatible_with_committed_schemas(generated: dict[str, dict[str, Any]]) -> None:
    broken = breaking(compare_files(schema_files.load_dir(SCHEMA_DIR), generated))
    assert not broken, (
        "backward-incompatible contract change (add fields as optional, or publish a new topic version):\n"
        + format_changes(broken)
    )


@pytest.fixture(scope="module")
def baseline() -> schema_files.Baseline:
    found = schema_files.load_baseline(BASELINE_DIR)
    assert found is not None and found.files, f"no release baseline in {BASELINE_DIR}; `{EXPORT} --cut-baseline`"
    return found


def test_code_is_backward_compatible_with_the_release_baseline(
    generated: dict[str, dict[str, Any]], baseline: schema_files.Baseline
) -> None:
    broken = breaking(compare_files(baseline.files, generated))
    assert not broken, (
        f"backward-incompatible change since release {baseline.version} (commit {baseline.commit}); add fields "
        "as optional, or publish a new topic version:\n" + format_changes(broken)
    )


def test_a_breaking_change_regenerated_into_the_committed_schemas_still_fails_against_the_baseline(
    generated: dict[str, dict[str, Any]], baseline: schema_files.Baseline
) -> None:
    """The committed files move with the code, so compared with them a regenerated breaking change is
    invisible; the baseline is the release and does not move."""
    code = copy.deepcopy(generated)
    state = code[RELEASED_EVENT]["$defs"]["AllocationState"]
    del state["properties"]["gpu_count"]
    state["required"] = [f for f in state.get("required", []) if f != "gpu_count"]
    regenerated = copy.deepcopy(code)  # as if `schemas_export --allow-breaking` had been run with it

    assert breaking(compare_files(regenerated, code)) == []
    found = {(c.where, c.message) for c in breaking(compare_files(baseline.files, code))}
    assert (f"{RELEASED_EVENT}: data.gpu_count", "field removed") in found


def test_the_baseline_holds_only_contracts_and_every_released_topic(baseline: schema_files.Baseline) -> None:
    assert baseline.files and all(p.startswith(("events/", "topics/", "agent/")) for p in baseline.files)
    assert baseline.version and baseline.commit
    released_topics = {p.removeprefix("topics/").removesuffix(".json") for p in baseline.files if p[:7] == "topics/"}
    assert released_topics <= set(TOPICS), "a released topic is gone (that is breaking)"


def _git(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", *args], cwd=SCHEMA_DIR.parent, input=stdin, capture_output=True, check=False)


def _schemas_at(ref: str) -> dict[str, dict[str, Any]] | None:
    """The schema files as committed at a git ref (None when git or the ref is unavailable)."""
    top = _git("rev-parse", "--show-toplevel")
    if top.returncode != 0:
        return None
    prefix = SCHEMA_DIR.relative_to(Path(top.stdout.decode().strip()).resolve()).as_posix()
    # --full-tree: the prefix is from the top of the repository, not from this directory.
    listing = _git("ls-tree", "--full-tree", "-r", "--name-only", ref, "--", prefix)
    if listing.returncode != 0:
        return None
    paths = [p for p in listing.stdout.decode().splitlines() if p.endswith(".json")]
    batch = _git("cat-file", "--batch", stdin="".join(f"{ref}:{p}\n" for p in paths).encode())
    out, files = batch.stdout, {}
    for path in paths:
        header, _, out = out.partition(b"\n")
        size = int(header.split()[2])
        files[path[len(prefix) + 1 :]] = json.loads(out[:size])
        out = out[size + 1 :]
    return files


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_baseline_is_the_schemas_of_its_release_commit(baseline: schema_files.Baseline) -> None:
    """The snapshot is what was committed at the release it names (not regenerated since). Skipped where
    the history does not reach that commit (a shallow clone): the snapshot itself is then the baseline."""
    if _git("cat-file", "-e", f"{baseline.commit}^{{commit}}").returncode != 0:
        pytest.skip(f"commit {baseline.commit} is not in this clone's history")
    at_release = _schemas_at(baseline.commit)
    assert at_release is not None
    released = schema_files.contract_files(at_release)
    # A family of schemas added after that release (the agent protocol, recorded in BASELINE.json) is in the
    # baseline from its introduction; the next cut makes it part of a release like the rest.
    families = {p.split("/")[0] for p in released}
    assert released == {p: d for p, d in baseline.files.items() if p.split("/")[0] in families}
    later = {p.split("/")[0] for p in baseline.files} - families
    record = json.loads((BASELINE_DIR / schema_files.BASELINE_RECORD).read_text())
    assert later <= ({"agent"} if "agent_protocol" in record else set()), later


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_code_is_backward_compatible_with_a_git_ref(generated: dict[str, dict[str, Any]]) -> None:
    """Optional, on top of the release baseline: GPUAAS_CONTRACTS_BASELINE names a git ref (e.g. the target
    branch `origin/main` in a pull request) whose committed schemas the code must stay compatible with."""
    ref = os.environ.get("GPUAAS_CONTRACTS_BASELINE")
    if not ref:
        pytest.skip("GPUAAS_CONTRACTS_BASELINE not set (the release baseline test covers the default)")
    committed = _schemas_at(ref)
    if not committed:
        pytest.fail(f"no committed schemas at GPUAAS_CONTRACTS_BASELINE={ref}")
    broken = breaking(compare_files(committed, generated))
    assert not broken, f"backward-incompatible change since {ref}:\n" + format_changes(broken)


def test_generation_is_deterministic(generated: dict[str, dict[str, Any]]) -> None:
    again = schema_files.generate()
    dumps = schema_files.dumps
    assert {p: dumps(d) for p, d in again.items()} == {p: dumps(d) for p, d in generated.items()}


def test_one_schema_per_event_type_and_per_topic(generated: dict[str, dict[str, Any]]) -> None:
    event_files = {p for p in generated if p.startswith("events/")}
    assert event_files == {f"events/{c.topic}/{t}.json" for t, c in EVENT_TYPES.items()}
    assert {p for p in generated if p.startswith("topics/")} == {f"topics/{t}.json" for t in TOPICS}
    for path in event_files:
        doc = generated[path]
        assert doc["properties"]["type"]["const"] == doc["x-gpuaas"]["type"]
        assert "$schema" in doc
    for name, topic in TOPICS.items():
        doc = generated[f"topics/{name}.json"]
        assert doc["x-gpuaas"]["event_types"] == sorted(topic.by_type)
        assert len(doc["oneOf"]) == len(topic.events)


def test_money_is_a_decimal_string_in_the_schema(generated: dict[str, dict[str, Any]]) -> None:
    doc = generated["events/gpuaas.billing.v1/charge.posted.json"]
    amount = doc["$defs"]["ChargeState"]["properties"]["amount"]
    assert amount["type"] == "string"
    assert amount["format"] == "decimal"


# --- the export command -----------------------------------------------------------------------


def test_export_writes_then_is_idempotent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert export(["--out", str(tmp_path)]) == 0
    assert len(list(tmp_path.rglob("*.json"))) == len(schema_files.generate())
    text = (tmp_path / "asyncapi.json").read_text(encoding="utf-8")
    assert text.endswith("}\n") and json.loads(text)["asyncapi"] == "3.0.0"

    assert export(["--out", str(tmp_path)]) == 0
    assert "0 file(s) updated" in capsys.readouterr().out
    assert export(["--out", str(tmp_path), "--check"]) == 0


def test_export_removes_files_no_longer_generated(tmp_path: Path) -> None:
    export(["--out", str(tmp_path)])
    leftover = tmp_path / "notes" / "old.json"
    leftover.parent.mkdir()
    leftover.write_text("{}\n")

    assert export(["--out", str(tmp_path), "--check"]) == 1
    assert export(["--out", str(tmp_path)]) == 0
    assert not leftover.exists() and not leftover.parent.exists()


def test_export_refuses_a_breaking_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    export(["--out", str(tmp_path)])
    path = tmp_path / "events/gpuaas.allocations.v1/allocation.activated.json"
    doc = json.loads(path.read_text())
    # As if the committed contract had a field the code no longer has.
    doc["$defs"]["AllocationState"]["properties"]["legacy_field"] = {"type": "string"}
    path.write_text(schema_files.dumps(doc))
    capsys.readouterr()

    assert export(["--out", str(tmp_path), "--check"]) == 1
    assert export(["--out", str(tmp_path)]) == 2
    assert "legacy_field" in path.read_text()
    assert "data.legacy_field: field removed" in capsys.readouterr().err

    assert export(["--out", str(tmp_path), "--allow-breaking"]) == 0
    assert "legacy_field" not in path.read_text()


def test_export_reports_stale_files_in_check_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    export(["--out", str(tmp_path)])
    (tmp_path / "asyncapi.json").write_text("{}\n")

    assert export(["--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "stale: asyncapi.json" in err
    assert "gpuaas.contracts.schemas_export" in err


def test_export_refuses_a_change_that_breaks_the_release_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, base = tmp_path / "schemas", tmp_path / "baseline"
    assert export(["--out", str(out), "--baseline", str(base), "--cut-baseline"]) == 0
    record = json.loads((base / "BASELINE.json").read_text())
    assert record["version"] and record["commit"] and record["files"] == len(list(base.rglob("*.json"))) - 1
    assert not (base / "asyncapi.json").exists()
    # The release had a field the code no longer has; the committed schemas already agree with the code.
    path = base / RELEASED_EVENT
    doc = json.loads(path.read_text())
    doc["$defs"]["AllocationState"]["properties"]["legacy_field"] = {"type": "string"}
    path.write_text(schema_files.dumps(doc))
    capsys.readouterr()

    assert export(["--out", str(out), "--baseline", str(base)]) == 2
    assert export(["--out", str(out), "--baseline", str(base), "--check"]) == 1
    err = capsys.readouterr().err
    assert "since release" in err and "data.legacy_field: field removed" in err
    assert export(["--out", str(out), "--baseline", str(base), "--allow-breaking"]) == 0
