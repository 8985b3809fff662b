"""JSON Schemas of every event type and every topic, generated from the pydantic models.

Schemas describe the wire format (pydantic "serialization" mode): Decimals are strings,
datetimes and UUIDs are formatted strings. This module builds one document at a time and imports
nothing of the contracts but the envelope and the registry; `gpuaas.contracts.asyncapi` builds on
it, and `gpuaas.contracts.schema_files` assembles both into the committed file set.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import models_json_schema

from gpuaas.contracts import agent
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


# The agent protocol's schemas describe what the reading side accepts (validation mode): both sides read.
AGENT_MODE = "validation"


def agent_schemas() -> dict[str, dict[str, Any]]:
    """The control plane ⇄ node agent protocol (`gpuaas.contracts.agent`), one document per body, task kind
    (input) and result kind, plus the two unions discriminated on `kind`:

        agent/<Body>.json   agent/tasks/<kind>.json   agent/results/<kind>.json
        agent/tasks.json    agent/results.json
    """
    meta = {"protocol_version": agent.PROTOCOL_VERSION, "module": "gpuaas.contracts.agent"}

    def one(model: type[BaseModel], **extra: Any) -> dict[str, Any]:
        schema = model.model_json_schema(mode=AGENT_MODE)
        schema["$schema"] = JSON_SCHEMA_DIALECT
        schema["x-gpuaas"] = {**meta, **extra}
        return schema

    def union(adapter: TypeAdapter[Any], title: str, kinds: list[str]) -> dict[str, Any]:
        schema = adapter.json_schema(mode=AGENT_MODE, ref_template="#/$defs/{model}")
        return {"$schema": JSON_SCHEMA_DIALECT, "title": title, **schema, "x-gpuaas": {**meta, "kinds": kinds}}

    files = {f"agent/{name}.json": one(model) for name, model in agent.MESSAGES.items()}
    for task in agent.TASK_TYPES:
        files[f"agent/tasks/{agent.kind_of(task)}.json"] = one(task, kind=agent.kind_of(task))
    for result in agent.RESULT_TYPES:
        files[f"agent/results/{agent.kind_of(result)}.json"] = one(result, kind=agent.kind_of(result))
    files["agent/tasks.json"] = union(
        TypeAdapter(agent.AgentTask), "AgentTask", sorted(agent.kind_of(t) for t in agent.TASK_TYPES)
    )
    files["agent/results.json"] = union(
        TypeAdapter(agent.AgentResult), "AgentResult", sorted(agent.kind_of(r) for r in agent.RESULT_TYPES)
    )
    return files


def event_path(event: type[Event]) -> str:
    return f"events/{event.topic}/{event.event_type()}.json"


def topic_path(topic: Topic) -> str:
    return f"topics/{topic.name}.json"
