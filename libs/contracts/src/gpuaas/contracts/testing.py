"""Valid sample payloads and events for tests, generated from the models.

Why: every service's tests (and this package's) need a valid instance of any event type;
deriving it from the model means a new field or event type is covered without writing a
fixture. Every optional field is filled (not left at None), so a round trip exercises all of
them. Values are deterministic: the n-th UUID of a sample is always the same.
"""

from __future__ import annotations

import itertools
import types
import typing
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from enum import Enum
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import AwareDatetime, BaseModel
from pydantic.fields import FieldInfo

from gpuaas.contracts.envelope import Actor, ActorKind, Event
from gpuaas.contracts.registry import TOPICS
from gpuaas.contracts.scalars import DIGEST_PATTERN, PINNED_REF_PATTERN

SAMPLE_DIGEST = "sha256:" + "ab" * 32
SAMPLE_DECIMAL = Decimal("12345.000000000000000001")
SAMPLE_TIME = datetime(2026, 1, 1, tzinfo=UTC)

_PATTERN_SAMPLES = {
    DIGEST_PATTERN: SAMPLE_DIGEST,
    PINNED_REF_PATTERN: f"registry.example/apps/sample@{SAMPLE_DIGEST}",
    r"^[A-Z]{3}$": "EUR",
    r"^[a-z0-9][a-z0-9-]*$": "sample-app",
}


class _Sampler:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._seconds = itertools.count(0)

    def model(self, cls: type[BaseModel]) -> dict[str, Any]:
        return {name: self.field(name, f) for name, f in cls.model_fields.items()}

    def field(self, name: str, info: FieldInfo) -> Any:
        return self.value(name, info.annotation, list(info.metadata))

    def value(self, name: str, annotation: Any, metadata: list[Any]) -> Any:
        origin = get_origin(annotation)
        if origin is Annotated:
            base, *extra = get_args(annotation)
            return self.value(name, base, metadata + _flatten(extra))
        if origin in (typing.Union, types.UnionType):
            options = [a for a in get_args(annotation) if a is not type(None)]
            return self.value(name, options[0], metadata)
        if origin is Literal:
            return get_args(annotation)[0]
        if origin is list:
            return [self.value(name, get_args(annotation)[0], [])]
        if origin is dict:
            return {"key": self.value(name, get_args(annotation)[1], [])}
        return self.scalar(name, annotation, metadata)

    def scalar(self, name: str, annotation: Any, metadata: list[Any]) -> Any:
        if annotation is Any:
            return "value"
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return self.model(annotation)
        if isinstance(annotation, type) and issubclass(annotation, Enum):
            return next(iter(annotation))
        if annotation is uuid.UUID:
            return uuid.UUID(int=next(self._ids))
        if annotation in (datetime, AwareDatetime):
            return SAMPLE_TIME + timedelta(seconds=next(self._seconds))
        if annotation is Decimal:
            return SAMPLE_DECIMAL
        if annotation is bool:
            return True
        if annotation is int:
            return _bounded_int(metadata)
        if annotation is float:
            return float(_bounded_int(metadata)) or 1.0
        if annotation is str:
            pattern = next((m.pattern for m in metadata if getattr(m, "pattern", None)), None)
            if pattern is None:
                return f"{name}-sample"
            if pattern not in _PATTERN_SAMPLES:
                raise ValueError(f"no sample for pattern {pattern!r} (field {name}); add one to testing.py")
            return _PATTERN_SAMPLES[pattern]
        raise TypeError(f"no sample for {annotation!r} (field {name})")


def _flatten(metadata: list[Any]) -> list[Any]:
    flat: list[Any] = []
    for m in metadata:
        flat.extend(m.metadata if isinstance(m, FieldInfo) else [m])
    return flat


def _bounded_int(metadata: list[Any]) -> int:
    """1, moved into the range of any ge/gt/le/lt constraints (annotated_types, duck-typed)."""
    value = 1
    for m in metadata:
        if (ge := getattr(m, "ge", None)) is not None:
            value = max(value, ge)
        if (gt := getattr(m, "gt", None)) is not None:
            value = max(value, gt + 1)
    for m in metadata:
        if (le := getattr(m, "le", None)) is not None:
            value = min(value, le)
        if (lt := getattr(m, "lt", None)) is not None:
            value = min(value, lt - 1)
    return value


def sample_payload(model: type[BaseModel]) -> Any:
    """A valid instance of `model` with every field set."""
    return model.model_validate(_Sampler().model(model))


def sample_event(event: type[Event], **attrs: Any) -> Event:
    """A valid event of this type, with all envelope attributes set (override with `attrs`)."""
    payload_model = event.payload_model()
    if payload_model is None:
        raise TypeError(f"{event.__name__} has no typed payload")
    owner = TOPICS[event.topic].owner
    defaults: dict[str, Any] = {
        "source": "tests" if owner == "*" else owner,
        "correlation_id": "corr-sample",
        "causation_id": uuid.UUID(int=999),
        "actor": Actor(kind=ActorKind.user, id="user-sample"),
    }
    return event.build(data=sample_payload(payload_model), **{**defaults, **attrs})
