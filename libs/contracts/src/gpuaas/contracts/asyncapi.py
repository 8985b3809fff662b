"""The AsyncAPI 3.0 document of every topic, generated from the registry.

Why generated: the registry is the single source of truth for which event travels on which
topic, who sends it and who consumes it; a hand-written document would drift.

Mapping: one channel per topic (`address` = topic name, Kafka binding with partitions and
cleanup policy), one message per event type (payload = the full CloudEvents envelope, Kafka
key = the aggregate id), one `send` operation for the owner of each topic and one `receive`
operation per consuming service. All payload schemas live in `components.schemas`, so every
`$ref` resolves inside this one document.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from pydantic.json_schema import models_json_schema

from gpuaas.contracts.envelope import Event
from gpuaas.contracts.registry import TOPICS, Topic
from gpuaas.contracts.schemas import MODE, key_description

ASYNCAPI_VERSION = "3.0.0"
KAFKA_BINDING_VERSION = "0.4.0"
EVERY_SERVICE = "*"


def contracts_version() -> str:
    """The version of the contracts package (the AsyncAPI document's and the baseline's)."""
    try:
        return metadata.version("gpuaas-contracts")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare source tree
        return "0.0.0"


def _summary(event: type[Event]) -> str:
    doc = (event.__doc__ or "").strip()
    return doc.splitlines()[0] if doc else f"`{event.event_type()}` event."


def _message(event: type[Event], payload_ref: str) -> dict[str, Any]:
    return {
        "name": event.event_type(),
        "title": event.__name__,
        "summary": _summary(event),
        "contentType": "application/json",
        "payload": {"$ref": payload_ref},
        "correlationId": {"location": "$message.payload#/correlation_id"},
        "bindings": {
            "kafka": {
                "key": {"type": "string", "description": key_description(event)},
                "bindingVersion": KAFKA_BINDING_VERSION,
            }
        },
        "x-gpuaas-aggregate-field": event.aggregate_field(),
    }


def _channel(topic: Topic) -> dict[str, Any]:
    return {
        "address": topic.name,
        "title": topic.name,
        "description": topic.description,
        "messages": {e.event_type(): {"$ref": f"#/components/messages/{e.event_type()}"} for e in topic.events},
        "bindings": {
            "kafka": {
                "topic": topic.name,
                "partitions": topic.partitions,
                "topicConfiguration": {"cleanup.policy": ["compact" if topic.compacted else "delete"]},
                "bindingVersion": KAFKA_BINDING_VERSION,
            }
        },
    }


def _operation(topic: Topic, action: str, service: str) -> dict[str, Any]:
    who = "every service" if service == EVERY_SERVICE else service
    verb = "publishes to" if action == "send" else "consumes"
    return {
        "action": action,
        "channel": {"$ref": f"#/channels/{topic.name}"},
        "summary": f"{who} {verb} {topic.name}",
        "messages": [{"$ref": f"#/channels/{topic.name}/messages/{e.event_type()}"} for e in topic.events],
        "x-gpuaas-service": service,
    }


def build_document() -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document (a plain dict, ready for `json.dumps`)."""
    events = [e for topic in TOPICS.values() for e in topic.events]
    refs, top = models_json_schema([(e, MODE) for e in events], ref_template="#/components/schemas/{model}")
    messages = {e.event_type(): _message(e, refs[(e, MODE)]["$ref"]) for e in events}
    channels = {topic.name: _channel(topic) for topic in TOPICS.values()}
    operations: dict[str, dict[str, Any]] = {}
    for topic in TOPICS.values():
        sender = "any-service" if topic.owner == EVERY_SERVICE else topic.owner
        operations[f"{sender}.send.{topic.name}"] = _operation(topic, "send", topic.owner)
        for consumer in topic.consumers:
            operations[f"{consumer}.receive.{topic.name}"] = _operation(topic, "receive", consumer)
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "GPUaaS control-plane events",
            "version": contracts_version(),
            "description": (
                "Every Kafka topic of the GPUaaS suite. Messages are CloudEvents 1.0 envelopes in "
                "structured JSON mode; `type` discriminates the event, `subject` (the aggregate id) is "
                "the Kafka key. Consumers ignore unknown fields and unknown event types."
            ),
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"schemas": top.get("$defs", {}), "messages": messages},
    }
