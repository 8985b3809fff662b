"""JSON Schemas of every event type and every topic, generated from the pydantic models.

Why: the committed schemas under `libs/contracts/schemas/` are the contract as it was agreed;
`gpuaas.contracts.compat` compares them with what the code generates now, so a change that
would break a consumer fails a test instead of a deployment. Non-Python consumers (and the
AsyncAPI document) read the same files.

Schemas describe the wire format (pydantic "serialization" mode): Decimals are strings,
datetimes and UUIDs are formatted strings. Layout, relative to the schema directory:

    events/<topic>/<event type>.json   one self-contained schema per event type
    topics/<topic>.json                the topic's union, discriminated on `type`
    asyncapi.json                      the AsyncAPI 3.0 document of all topics
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

from pydantic.json_schema import models_json_schema

from gpuaas.contracts.envelope import Event
from gpuaas.contracts.registry import TOPICS, Topic

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
MODE = "serialization"


def key_description(event: type[Event]) -> str:
    field = event.aggregate_field()
    where = f"`data.{field}`" if field else "the aggregate id"
    return f"Kafka key = envelope `subject` = {where}"


def event_metadata(event: type[Event]) -> dict[str, Any]:
    return {
        "topic": event.topic,
        "type": event.event_type(),
        "owner": TOPICS[event.topic].owner,
        "aggregate_field": event.aggregate_field(),
        "key": key_description(event),
    }


def event_schema(event: type[Event]) -> dict[str, Any]:
    """A self-contained JSON Schema (local `#/$defs/...` refs) of one event type."""
    schema = event.model_json_schema(mode=MODE)
    schema["$schema"] = JSON_SCHEMA_DIALECT
    schema["x-gpuaas"] = event_metadata(event)
    return schema


def topic_schema(topic: Topic) -> dict[str, Any]:
    """The topic's union: `oneOf` its event types, with a discriminator mapping on `type`."""
    refs, top = models_json_schema([(e, MODE) for e in topic.events], ref_template="#/$defs/{model}")
    mapping = {e.event_type(): refs[(e, MODE)]["$ref"] for e in topic.events}
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "title": topic.name,
        "description": topic.description,
        "oneOf": [{"$ref": ref} for ref in mapping.values()],
        "discriminator": {"propertyName": "type", "mapping": mapping},
        "$defs": top.get("$defs", {}),
        "x-gpuaas": {
            "topic": topic.name,
            "owner": topic.owner,
            "consumers": list(topic.consumers),
            "compacted": topic.compacted,
            "partitions": topic.partitions,
            "event_types": sorted(mapping),
        },
    }


def event_path(event: type[Event]) -> str:
    return f"events/{event.topic}/{event.event_type()}.json"


def topic_path(topic: Topic) -> str:
    return f"topics/{topic.name}.json"


ASYNCAPI_PATH = "asyncapi.json"


def generate() -> dict[str, dict[str, Any]]:
    """Every schema document by its path relative to the schema directory (a fresh copy)."""
    return copy.deepcopy(_generate())


@functools.cache
def _generate() -> dict[str, dict[str, Any]]:
    # Models do not change at runtime, so the (slow-ish) generation runs once per process.
    from gpuaas.contracts.asyncapi import build_document  # asyncapi imports this module

    files: dict[str, dict[str, Any]] = {}
    for topic in TOPICS.values():
        files[topic_path(topic)] = topic_schema(topic)
        for event in topic.events:
            files[event_path(event)] = event_schema(event)
    files[ASYNCAPI_PATH] = build_document()
    return dict(sorted(files.items()))


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


def default_schema_dir() -> Path | None:
    """`libs/contracts/schemas` in a source checkout; None when running from an installed wheel."""
    root = Path(__file__).resolve().parents[3]
    return root / "schemas" if (root / "pyproject.toml").is_file() and (root / "src").is_dir() else None
