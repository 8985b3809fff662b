"""Typed event handlers, grouped per service: `@subs.on(AllocationActivated)`.

A handler gets the session of the consumer's unit of work and the parsed event; it must not call
out on the network (its effects commit together with the inbox row).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Event, topic_of

E = TypeVar("E", bound=Event)
Handler = Callable[[AsyncSession, Any], Awaitable[None]]


class Subscriptions:
    def __init__(self) -> None:
        self.handlers: dict[str, list[Handler]] = {}
        self.topics: set[str] = set()

    def on(self, *event_types: type[Event]) -> Callable[[Handler], Handler]:
        def register(fn: Handler) -> Handler:
            for et in event_types:
                self.handlers.setdefault(et.event_type(), []).append(fn)
                self.topics.add(topic_of(et).name)
            return fn

        return register

    def merge(self, *others: Subscriptions) -> Subscriptions:
        merged = Subscriptions()
        for s in (self, *others):
            for t, hs in s.handlers.items():
                merged.handlers.setdefault(t, []).extend(hs)
            merged.topics |= s.topics
        return merged
