"""Typed event handlers, grouped per service: `@subs.on(AllocationActivated)`.

A handler gets the session of the consumer's unit of work and the parsed event; it must not call
out on the network (its effects commit together with the inbox row).

A batch handler (`@subs.on_batch(UsageRecorded)`) gets every fresh event of its types that arrive
next to each other in a consumed batch, in order, in one call: a handler whose per-event cost is
mostly round trips (billing's rating) does a batch in a fixed number of statements. When the batch
must be isolated event by event (a failing handler), it is called with one event at a time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Event, topic_of

E = TypeVar("E", bound=Event)
Handler = Callable[[AsyncSession, Any], Awaitable[None]]
BatchHandler = Callable[[AsyncSession, list[Any]], Awaitable[None]]


class Subscriptions:
    def __init__(self) -> None:
        self.handlers: dict[str, list[Handler]] = {}
        self.topics: set[str] = set()
        # event type -> the batch handler that takes it (also registered one-event-at-a-time in `handlers`)
        self.batch: dict[str, BatchHandler] = {}

    def on(self, *event_types: type[Event]) -> Callable[[Handler], Handler]:
        def register(fn: Handler) -> Handler:
            for et in event_types:
                if et.event_type() in self.batch:
                    raise ValueError(f"{et.event_type()} has a batch handler: it must be the type's only handler")
                self.handlers.setdefault(et.event_type(), []).append(fn)
                self.topics.add(topic_of(et).name)
            return fn

        return register

    def on_batch(self, *event_types: type[Event]) -> Callable[[BatchHandler], BatchHandler]:
        def register(fn: BatchHandler) -> BatchHandler:
            async def one(session: AsyncSession, event: Any) -> None:
                await fn(session, [event])

            for et in event_types:
                if et.event_type() in self.handlers:
                    raise ValueError(f"{et.event_type()}: a batch handler must be the type's only handler")
            self.on(*event_types)(one)
            self.batch.update({et.event_type(): fn for et in event_types})
            return fn

        return register

    def merge(self, *others: Subscriptions) -> Subscriptions:
        merged = Subscriptions()
        for s in (self, *others):
            for t, hs in s.handlers.items():
                merged.handlers.setdefault(t, []).extend(hs)
            merged.topics |= s.topics
            merged.batch.update(s.batch)
        return merged
