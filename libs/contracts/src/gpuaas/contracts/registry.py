"""The topic registry: which events travel on which topic, and how to parse them.

A topic's union is discriminated on the envelope's `type`. Consumers skip event types they
do not know (a newer producer may add types within a topic version). Every event type belongs
to exactly one topic (checked when this module is imported).

`owner` is the only service that publishes on a topic (`"*"`: every service); `consumers`
lists the services that subscribe (documentation, AsyncAPI and broker ACLs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Annotated, Any, Union, cast

from pydantic import Field, TypeAdapter

from gpuaas.contracts.envelope import Event
from gpuaas.contracts.events import allocations, app_runtime, audit, billing, catalog, identity, usage


@dataclass(frozen=True)
class Topic:
    name: str
    owner: str
    description: str
    events: tuple[type[Event], ...]
    # Topics that feed projections carry full entity state keyed by entity id: compacted on Apache Kafka.
    compacted: bool = False
    partitions: int = 4
    consumers: tuple[str, ...] = ()
    by_type: dict[str, type[Event]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_type", {e.event_type(): e for e in self.events})
        if len(self.by_type) != len(self.events):
            raise ValueError(f"{self.name}: duplicate event type")
        for e in self.events:
            if vars(e).get("topic", "") not in ("", self.name):
                raise ValueError(f"{e.event_type()} is already on {e.topic}; an event type has one topic")
        for e in self.events:
            e.topic = self.name

    @cached_property
    def union(self) -> TypeAdapter[Any]:
        """TypeAdapter of this topic's discriminated union."""
        if len(self.events) == 1:
            return TypeAdapter[Any](self.events[0])
        members = Union[tuple(self.events)]  # noqa: UP007 - a runtime-built Union
        # A union built at run time from the topic's events: a type to pydantic, a variable to the checker.
        return TypeAdapter[Any](Annotated[members, Field(discriminator="type")])  # pyright: ignore[reportInvalidTypeForm, reportArgumentType]

    def parse(self, raw: bytes | str | dict[str, Any]) -> Event | None:
        """Parse one message; None when its type is unknown to this version of the contracts.

        Raises pydantic.ValidationError (or ValueError for non-JSON) on a malformed message.
        """
        doc = json.loads(raw) if isinstance(raw, bytes | str) else raw
        if not isinstance(doc, dict):
            raise ValueError("event is not a JSON object")
        if cast(dict[str, Any], doc).get("type") not in self.by_type:
            return None
        return self.union.validate_python(doc)


IDENTITY = "gpuaas.identity.v1"
ALLOCATIONS = "gpuaas.allocations.v1"
CATALOG = "gpuaas.catalog.v1"
APP_RUNTIME = "gpuaas.app-runtime.v1"
USAGE = "gpuaas.usage.v1"
BILLING = "gpuaas.billing.v1"
AUDIT = "gpuaas.audit.v1"

# Every service keeps an IAM projection of identity (gpuaas.kit.iam).
_SERVICES = ("identity", "allocations", "catalog", "app-runtime", "metering", "billing")

_ALL: list[Topic] = [
    Topic(
        IDENTITY,
        "identity",
        "Tenants, projects, users, memberships and service accounts (full state per event).",
        identity.EVENTS,
        compacted=True,
        consumers=tuple(s for s in _SERVICES if s != "identity"),
    ),
    Topic(
        ALLOCATIONS,
        "allocations",
        "Hosts, allocations (lifecycle), SSH grants and volumes (full state per event).",
        allocations.EVENTS,
        compacted=True,
        consumers=("app-runtime", "metering"),
    ),
    Topic(
        CATALOG,
        "catalog",
        "App manifests, artifacts (promotion lifecycle) and entitlements (full state per event).",
        catalog.EVENTS,
        compacted=True,
        consumers=("app-runtime", "allocations"),
    ),
    Topic(
        APP_RUNTIME,
        "app-runtime",
        "App instances, members, member operations, controller access grants and release clearances.",
        app_runtime.EVENTS,
        compacted=True,
        consumers=("allocations", "catalog", "metering"),
    ),
    Topic(
        USAGE,
        "metering",
        "Meters of allocations, GPU usage records per window and app usage records (facts; not compacted).",
        usage.EVENTS,
        consumers=("billing",),
    ),
    Topic(
        BILLING,
        "billing",
        "Price book entries, posted charges, budget alerts and closed statements.",
        billing.EVENTS,
    ),
    Topic(
        AUDIT,
        "*",
        "One audit record per mutation in any service; stored by identity.",
        audit.EVENTS,
        consumers=("identity",),
    ),
]

TOPICS: dict[str, Topic] = {t.name: t for t in _ALL}

EVENT_TYPES: dict[str, type[Event]] = {}
"""Every registered event class by its `type`; event types are unique across topics."""
for _topic in _ALL:
    for _type, _cls in _topic.by_type.items():
        if _type in EVENT_TYPES:
            raise ValueError(f"event type {_type!r} is registered twice")
        EVENT_TYPES[_type] = _cls


def topic_of(event: type[Event] | Event) -> Topic:
    cls = event if isinstance(event, type) else type(event)
    return TOPICS[cls.topic]


def parse_event(topic: str, raw: bytes | str | dict[str, Any]) -> Event | None:
    return TOPICS[topic].parse(raw)
