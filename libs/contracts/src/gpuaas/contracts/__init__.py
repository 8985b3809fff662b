"""Shared contracts of the GPUaaS suite: the event envelope, every event type, the topic registry.

Only pydantic and the standard library: every service, the SDK and app controllers import this.
Event payloads live in `gpuaas.contracts.events.<topic>`; the JSON Schemas and AsyncAPI document
generated from them are written by `python -m gpuaas.contracts.schemas_export`.
"""

from gpuaas.contracts.envelope import Actor, ActorKind, Event, Payload, new_event_id, stable_id
from gpuaas.contracts.registry import EVENT_TYPES, TOPICS, Topic, parse_event, topic_of

__all__ = [
    "EVENT_TYPES",
    "TOPICS",
    "Actor",
    "ActorKind",
    "Event",
    "Payload",
    "Topic",
    "new_event_id",
    "parse_event",
    "stable_id",
    "topic_of",
]
