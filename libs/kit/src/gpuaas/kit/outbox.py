"""Transactional outbox: a use case adds its events to the `outbox` table in its own transaction.

The relay (relay.py) publishes them; nothing in a request path talks to Kafka directly.

Events of `SEQUENCED_TOPICS` get their envelope `sequence` here, from the schema's `event_sequence`: a
use case holds its aggregate's lock while it emits, so a later change of one record always draws a higher
number, whatever the clocks say. Consumers' projections order by it (kit.iam).
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Event, topic_of
from gpuaas.contracts.registry import IDENTITY
from gpuaas.kit import context
from gpuaas.kit.bulk import insert_rows
from gpuaas.kit.errors import Problem
from gpuaas.kit.tables import outbox

MAX_EVENT_BYTES = 900_000  # below the broker limit we enforce (Tansu enforces none)
SEQUENCED_TOPICS = frozenset({IDENTITY})
_NEXT_SEQUENCES = text("SELECT nextval('event_sequence') FROM generate_series(1, :n)")


def _row(event: Event) -> dict[str, object]:
    # Events inherit the request's or the handled event's correlation/causation.
    if event.correlation_id is None:
        event.correlation_id = context.correlation_id.get()
    if event.causation_id is None:
        event.causation_id = context.causation_id.get()
    payload = event.model_dump_json().encode()
    if len(payload) > MAX_EVENT_BYTES:
        raise Problem(
            f"event {event.type} is {len(payload)} bytes; the limit is {MAX_EVENT_BYTES}",
            code="event_too_large",
            status=413,
        )
    return {
        "event_id": event.id,
        "topic": topic_of(event).name,
        "event_type": event.type,
        "aggregate_id": event.subject,
        "payload": payload,
        "headers": {"correlation_id": event.correlation_id or "", "event_type": event.type},
    }


async def add_events(session: AsyncSession, events: Iterable[Event]) -> None:
    """Stage events in the caller's transaction; they are published only if it commits."""
    events = list(events)
    unsequenced = [e for e in events if e.sequence is None and topic_of(e).name in SEQUENCED_TOPICS]
    if unsequenced:
        numbers = (await session.execute(_NEXT_SEQUENCES, {"n": len(unsequenced)})).scalars().all()
        for event, number in zip(unsequenced, numbers, strict=True):
            event.sequence = number
    rows = [_row(e) for e in events]
    if rows:  # one statement of a fixed shape for any number of events (unnest of arrays)
        await insert_rows(session, outbox, rows)


async def add_event(session: AsyncSession, event: Event) -> None:
    await add_events(session, [event])
