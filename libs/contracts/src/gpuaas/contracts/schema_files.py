"""The schema files: the whole generated set, its committed text form, reading a directory, and the
release baseline.

Two directories under `libs/contracts/`, both compared with what the code generates now by
`gpuaas.contracts.compat` (tests and `schemas_export --check`), so a change that would break a
consumer fails a test instead of a deployment:

- `schemas/`: the contract as it is now, regenerated with every change (non-Python consumers read it).
  On its own it only catches a breaking change made *without* regenerating.
- `baseline/`: the contract as released: the event and topic schemas of the release commit named in
  `baseline/BASELINE.json`, replaced only when a release is cut (`schemas_export --cut-baseline`). A
  breaking change regenerated into `schemas/` still breaks against it. It is a committed snapshot, not a
  git ref, so that a fresh (shallow) clone in CI has it.

Layout, relative to either directory:

    events/<topic>/<event type>.json   one self-contained schema per event type
    topics/<topic>.json                the topic's union, discriminated on `type`
    agent/...                          the control plane ⇄ node agent protocol (`schemas.agent_schemas`)
    asyncapi.json                      the AsyncAPI 3.0 document (schemas/ only: derived, never compared)
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuaas.contracts.asyncapi import build_document, contracts_version
from gpuaas.contracts.registry import TOPICS
from gpuaas.contracts.schemas import agent_schemas, event_path, event_schema, topic_path, topic_schema

ASYNCAPI_PATH = "asyncapi.json"
BASELINE_RECORD = "BASELINE.json"
CONTRACT_DIRS = ("events/", "topics/", "agent/")  # the files that are contracts; the rest is derived


def generate() -> dict[str, dict[str, Any]]:
    """Every schema document by its path relative to the schema directory (a fresh copy)."""
    return copy.deepcopy(_generate())


@functools.cache
def _generate() -> dict[str, dict[str, Any]]:
    # Models do not change at runtime, so the (slow-ish) generation runs once per process.
    files: dict[str, dict[str, Any]] = {}
    for topic in TOPICS.values():
        files[topic_path(topic)] = topic_schema(topic)
        for event in topic.events:
            files[event_path(event)] = event_schema(event)
    files.update(agent_schemas())
    files[ASYNCAPI_PATH] = build_document()
    return dict(sorted(files.items()))


def contract_files(documents: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Only the event, topic and agent protocol schemas (what a baseline holds)."""
    return {path: doc for path, doc in documents.items() if path.startswith(CONTRACT_DIRS)}


def dumps(document: dict[str, Any]) -> str:
    """Deterministic text: sorted keys, two-space indent, trailing newline."""
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def load_dir(directory: Path) -> dict[str, dict[str, Any]]:
    """The schema documents under `directory`, by relative POSIX path."""
    if not directory.is_dir():
        return {}
    return {
        p.relative_to(directory).as_posix(): json.loads(p.read_text(encoding="utf-8"))
        for p in sorted(directory.rglob("*.json"))
    }


def _source_root() -> Path | None:
    """`libs/contracts` in a source checkout; None when running from an installed wheel."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").is_file() and (root / "src").is_dir() else None


def default_schema_dir() -> Path | None:
    root = _source_root()
    return root / "schemas" if root else None


def default_baseline_dir() -> Path | None:
    root = _source_root()
    return root / "baseline" if root else None


@dataclass(frozen=True)
class Baseline:
    """The released contract: its version, the commit it was taken from, and its event and topic schemas."""

    version: str
    commit: str
    files: dict[str, dict[str, Any]]


def load_baseline(directory: Path) -> Baseline | None:
    """The baseline under `directory`; None when there is none (no record file)."""
    record = directory / BASELINE_RECORD
    if not record.is_file():
        return None
    meta = json.loads(record.read_text(encoding="utf-8"))
    return Baseline(version=meta["version"], commit=meta["commit"], files=contract_files(load_dir(directory)))


def write_baseline(directory: Path, documents: dict[str, dict[str, Any]], commit: str) -> Baseline:
    """Replace the baseline with `documents`' event and topic schemas, recorded as taken from `commit`."""
    files = contract_files(documents)
    for old in directory.rglob("*.json") if directory.is_dir() else ():
        old.unlink()
    for path, doc in files.items():
        target = directory / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(dumps(doc), encoding="utf-8")
    for folder in sorted((p for p in directory.rglob("*") if p.is_dir()), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()
    baseline = Baseline(version=contracts_version(), commit=commit, files=files)
    record = {"version": baseline.version, "commit": commit, "files": len(files)}
    (directory / BASELINE_RECORD).write_text(dumps(record), encoding="utf-8")
    return baseline
