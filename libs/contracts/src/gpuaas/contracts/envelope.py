"""The event envelope: CloudEvents 1.0 attributes plus tenancy, tracing and actor.

One pydantic model per event type subclasses `Event`, narrows `type` to a `Literal` and
types `data`. A topic's discriminated union is built from those `Literal`s (see registry.py).
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar, Self, cast

from pydantic import BaseModel, ConfigDict, Field


def new_event_id() -> uuid.UUID:
    """UUIDv7 (RFC 9562): time-ordered, so ids sort by creation time.

    Written here rather than imported so that contracts stay dependency-free; Python 3.11 has no uuid7.
    """
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version
    value |= ((rand >> 68) & 0xFFF) << 64
    value |= 0b10 << 62  # variant
    value |= rand & ((1 << 62) - 1)
    return uuid.UUID(int=value)


_STABLE_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:gpuaas:stable-id")


def _canonical(part: object) -> str:
    if isinstance(part, datetime):
        if part.tzinfo is None:
            raise ValueError("stable_id needs timezone-aware datetimes")
        return part.astimezone(UTC).isoformat()
    return str(part)


def stable_id(kind: str, *parts: object) -> uuid.UUID:
    """Deterministic id (UUIDv5) of `kind` and `parts`.

    Used where the id itself is the idempotency guard: a producer that retries (or a replayed
    computation) derives the same id, and consumers that key on it do the work once. Datetimes
    are normalised to UTC, so the same instant in another zone gives the same id.
    """
    name = "\x1f".join([kind, *(_canonical(p) for p in parts)])
    return uuid.uuid5(_STABLE_NAMESPACE, name)


class ActorKind(StrEnum):
    user = "user"
    service_account = "service_account"
    system = "system"


class Actor(BaseModel):
    """Who caused the event: a user, a project service account, or the platform itself."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: ActorKind
    id: str

    @classmethod
    def system(cls, component: str) -> Actor:
        return cls(kind=ActorKind.system, id=component)


class Payload(BaseModel):
    """Base of every event's `data`: unknown fields from newer producers are ignored.

    `aggregate_field` names the field holding the id of the entity the payload is about: it is
    the envelope `subject` and so the Kafka key (one entity's events stay ordered and, on a
    compacted topic, the latest full state per entity is kept).
    """

    model_config = ConfigDict(extra="ignore")

    aggregate_field: ClassVar[str | None] = None


def _attr(data: Any, name: str) -> Any:
    return cast(dict[str, Any], data).get(name) if isinstance(data, dict) else getattr(data, name, None)


class Event(BaseModel):
    """CloudEvents 1.0 envelope. Subclasses set `type: Literal[...]` and `data: <Payload>`."""

    model_config = ConfigDict(extra="ignore")

    # Filled in by subclasses: which topic the event belongs to (set by the registry).
    topic: ClassVar[str] = ""

    specversion: str = "1.0"
    id: uuid.UUID = Field(default_factory=new_event_id)
    type: str
    source: str = Field(description="producing service, e.g. 'allocations'")
    time: datetime = Field(default_factory=lambda: datetime.now(UTC))
    subject: str = Field(description="aggregate id; also the Kafka key, so one aggregate stays ordered")
    tenant_id: uuid.UUID | None = None
    project_id: uuid.UUID | None = None
    correlation_id: str | None = None
    causation_id: uuid.UUID | None = None
    actor: Actor = Field(default_factory=lambda: Actor.system("platform"))
    schema_version: int = 1
    datacontenttype: str = "application/json"
    data: Any  # every event class types it (and gives it no default: an event always carries its payload)
    # Order of one subject's events, set by the producer's outbox (a database sequence, never a clock):
    # projections keep the state of the highest `sequence` they have seen, so a clock step cannot reorder them.
    sequence: int | None = Field(
        default=None, description="per-subject order stamped by the producer (higher is newer); not a time"
    )
    # `ed25519:<kid>:<base64>` over the canonical envelope bytes (gpuaas.kit.event_signing), set by the
    # producing service's relay; consumers of access-granting topics accept only their owner's signature.
    signature: str | None = Field(default=None, description="producer's signature over the canonical envelope")

    @classmethod
    def event_type(cls) -> str:
        """The `type` literal of this event class."""
        return cls.model_fields["type"].default

    @classmethod
    def payload_model(cls) -> type[Payload] | None:
        """The `data` model of this event class (None on the untyped base)."""
        annotation = cls.model_fields["data"].annotation
        return annotation if isinstance(annotation, type) and issubclass(annotation, Payload) else None

    @classmethod
    def aggregate_field(cls) -> str | None:
        """Name of the `data` field whose value is this event's subject (and Kafka key)."""
        model = cls.payload_model()
        return model.aggregate_field if model is not None else None

    @classmethod
    def build(cls, *, data: Any, source: str, subject: Any = None, **attrs: Any) -> Self:
        """Build an event of this type: `type` comes from the class, `subject` is stringified.

        Without `subject`, it is read from the payload's aggregate field (e.g. `allocation_id`).
        `tenant_id` / `project_id` default to the payload's fields of the same name, so that
        tenancy filters on the envelope agree with the payload.
        """
        if subject is None:
            field = cls.aggregate_field()
            subject = _attr(data, field) if field else None
            if subject is None:
                raise ValueError(f"{cls.__name__}.build needs a subject (no aggregate id in data)")
        for name in ("tenant_id", "project_id"):
            if name not in attrs and (value := _attr(data, name)) is not None:
                attrs[name] = value
        return cls(type=cls.event_type(), subject=str(subject), data=data, source=source, **attrs)

    def key(self) -> bytes:
        return self.subject.encode()
