"""FastStream integration for consumers of the platform's topics (extra: `gpuaas-contracts[faststream]`).

What a downstream consumer (a finance export, a warehouse loader, an audit archive) needs on top of the
contracts, on FastStream's Kafka broker:

- `event_subscriber(...)`: a **batch** subscriber of one or more topics (one consumer group for all of
  them, under the deployment's topic prefix) whose handler receives the envelopes already decoded into the
  typed event union of those topics (`list[Event]`, each a concrete class such as `ChargePosted`). Event
  types this version of the contracts does not know (a newer producer, ARCHITECTURE §4) and malformed
  messages are skipped and logged, never passed on.
- `EnvelopeMeta` / `meta(event)`: the envelope's metadata (event id, type, source, subject, tenant,
  project, correlation, causation, actor) without the payload.
- `PgInbox`: exactly-once *effects* in the consumer's own Postgres (asyncpg). The handler runs inside one
  transaction together with the inbox rows (event id unique per consumer); only events not seen before are
  handed to it; the Kafka offsets are committed after that transaction commits. A crash before the commit
  redelivers the batch (nothing of it was applied); a crash between the commit and the offset commit
  redelivers it too, and the inbox drops every event in it. On a failure the subscriber rewinds to the
  batch's first offsets (nack) and the batch is tried again.
- `asyncapi(broker)`: the consumer's own AsyncAPI 3.0 document (what it subscribes to, with the typed
  payloads), the same document `faststream docs gen` writes.

FastStream is imported only here: `import gpuaas.contracts` stays pydantic-only.

    broker = KafkaBroker(bootstrap)
    inbox = PgInbox(pool, schema="billing_export", consumer="billing-export")

    @event_subscriber(broker, BILLING, group="billing-export", prefix=prefix, inbox=inbox)
    async def on_billing(conn: asyncpg.Connection, events: list[Event]) -> None:
        ...  # write with `conn`: same transaction as the inbox rows
"""

# No `from __future__ import annotations`: the handler built below is annotated with the runtime-built
# union, which FastStream reads from the signature (validation and AsyncAPI).
# aiokafka and asyncpg ship no type information, so what this module gets back from them is unknown to the
# checker: it does not report those unknowns here (what the module itself exports is annotated).
# pyright: reportMissingTypeStubs=false, reportUnknownMemberType=false
# pyright: reportUnknownVariableType=false, reportUnknownArgumentType=false

import asyncio
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Union, cast

try:
    import asyncpg
    from aiokafka import TopicPartition
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker, KafkaRouter
    from faststream.kafka.annotations import KafkaMessage
    from faststream.message import StreamMessage
    from faststream.specification import AsyncAPI
except ImportError as exc:  # pragma: no cover - the base package without the extra
    raise ImportError(
        f"gpuaas.contracts.faststream needs the extra: pip install 'gpuaas-contracts[faststream]' ({exc})"
    ) from exc
from pydantic import Field, ValidationError

from gpuaas.contracts.envelope import Actor, Event
from gpuaas.contracts.registry import TOPICS, Topic

log = logging.getLogger("gpuaas.contracts.faststream")

Handler = Callable[[asyncpg.Connection, list[Event]], Awaitable[None]]
_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


@dataclass(frozen=True)
class EnvelopeMeta:
    """The CloudEvents envelope of an event without its payload."""

    event_id: uuid.UUID
    type: str
    topic: str
    source: str
    subject: str
    time: datetime
    tenant_id: uuid.UUID | None
    project_id: uuid.UUID | None
    correlation_id: str | None
    causation_id: uuid.UUID | None
    actor: Actor


def meta(event: Event) -> EnvelopeMeta:
    return EnvelopeMeta(
        event_id=event.id,
        type=event.type,
        topic=type(event).topic,
        source=event.source,
        subject=event.subject,
        time=event.time,
        tenant_id=event.tenant_id,
        project_id=event.project_id,
        correlation_id=event.correlation_id,
        causation_id=event.causation_id,
        actor=event.actor,
    )


def _topics(names: Sequence[str]) -> list[Topic]:
    unknown = [n for n in names if n not in TOPICS]
    if unknown:
        raise ValueError(f"unknown topics {unknown}; known: {sorted(TOPICS)}")
    return [TOPICS[n] for n in names]


def event_union(*topics: str) -> Any:
    """The typed union of every event of `topics`, discriminated on the envelope's `type`."""
    events = [e for t in _topics(topics) for e in t.events]
    if len(events) == 1:
        return events[0]
    return Annotated[Union[tuple(events)], Field(discriminator="type")]  # noqa: UP007 - runtime-built


def decode_records(
    records: Sequence[tuple[str, bytes | None]], *, prefix: str = "", skipped: list[str] | None = None
) -> list[Event]:
    """Decode (wire topic, value) pairs into typed events, in order; unknown types and malformed messages
    are skipped (logged, and described in `skipped` when given)."""
    out: list[Event] = []
    for wire_topic, value in records:
        name = wire_topic.removeprefix(prefix)
        topic = TOPICS.get(name)
        reason = None
        if topic is None:
            reason = f"not a contracts topic: {wire_topic}"
        else:
            try:
                event = topic.parse(value or b"")
            except (ValidationError, ValueError) as exc:  # JSONDecodeError is a ValueError
                reason = f"malformed event on {name}: {str(exc).splitlines()[0]}"
            else:
                if event is None:
                    reason = f"unknown event type on {name}: {_type_of(value)}"
                else:
                    out.append(event)
        if reason:
            log.warning("event_skipped: %s", reason)
            if skipped is not None:
                skipped.append(reason)
    return out


def _type_of(value: bytes | None) -> str:
    try:
        return str(json.loads(value or b"{}").get("type"))
    except (ValueError, AttributeError):
        return "?"


def _decoder(prefix: str) -> Callable[[StreamMessage[Any]], Awaitable[list[Event]]]:
    async def decode(msg: StreamMessage[Any]) -> list[Event]:
        raw = msg.raw_message
        records = raw if isinstance(raw, tuple | list) else (raw,)  # a list under TestKafkaBroker
        return decode_records([(r.topic, r.value) for r in records], prefix=prefix)

    return decode


class PgInbox:
    """The consumer-side inbox in the consumer's own Postgres schema: `<schema>.inbox`, one row per
    (consumer, event id). `apply()` runs the handler and the inbox rows in one transaction."""

    def __init__(self, pool: asyncpg.Pool | Callable[[], asyncpg.Pool], *, schema: str, consumer: str) -> None:
        """`pool`, or a function returning it (a subscriber is registered before its app opens the pool)."""
        if not _IDENT.match(schema):
            raise ValueError(f"schema {schema!r}: lower-case identifier expected")
        self._pool = pool
        self.schema = schema
        self.consumer = consumer

    @property
    def pool(self) -> asyncpg.Pool:
        return self._pool if isinstance(self._pool, asyncpg.Pool) else self._pool()

    async def setup(self, conn: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy | None = None) -> None:
        ddl = f"""
        CREATE SCHEMA IF NOT EXISTS {self.schema};
        CREATE TABLE IF NOT EXISTS {self.schema}.inbox (
            consumer text NOT NULL,
            event_id uuid NOT NULL,
            topic text NOT NULL,
            type text NOT NULL,
            received_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (consumer, event_id)
        )"""
        if conn is not None:
            await conn.execute(ddl)
            return
        async with self.pool.acquire() as c:
            await c.execute(ddl)

    async def apply(self, events: Sequence[Event], handler: Handler) -> list[Event]:
        """In one transaction: record every event id not yet in the inbox and run `handler` on those
        events (in batch order). Returns the events handled; an exception rolls back both."""
        unique: dict[uuid.UUID, Event] = {}
        for e in events:
            unique.setdefault(e.id, e)
        if not unique:
            return []
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                f"""INSERT INTO {self.schema}.inbox (consumer, event_id, topic, type)
                    SELECT $1, * FROM unnest($2::uuid[], $3::text[], $4::text[])
                    ON CONFLICT DO NOTHING RETURNING event_id""",
                self.consumer,
                list(unique),
                [type(e).topic for e in unique.values()],
                [e.type for e in unique.values()],
            )
            fresh = {r["event_id"] for r in rows}
            new = [e for e in unique.values() if e.id in fresh]
            if new:
                await handler(cast(asyncpg.Connection, conn), new)  # the pool's proxy of a Connection
        return new


def event_subscriber(
    broker: KafkaBroker | KafkaRouter,
    *topics: str,
    group: str,
    inbox: PgInbox,
    prefix: str = "",
    max_records: int = 500,
    retry_backoff_s: float = 1.0,
    **subscriber_kwargs: Any,
) -> Callable[[Handler], Handler]:
    """Register `handler(conn, events)` as a batch subscriber of `topics` (logical names, e.g.
    `gpuaas.billing.v1`) in consumer group `group`, both under `prefix` on the broker (the platform's
    `GPUAAS_KAFKA_TOPIC_PREFIX`). Every fetched batch: decode → inbox + handler in one transaction →
    commit the offsets; on an exception the partitions are rewound to the batch (nothing committed) and
    the batch is fetched again after `retry_backoff_s`. A new group starts at the earliest offset (the
    inbox makes re-reading harmless)."""
    _topics(topics)
    union = event_union(*topics)

    def register(handler: Handler) -> Handler:
        # `union` is built at run time from the topics (FastStream reads it from this signature).
        async def consume(events: list[union], message: KafkaMessage) -> None:  # pyright: ignore[reportInvalidTypeForm, reportUnknownParameterType]
            try:
                await inbox.apply(events, handler)
            except BaseException:
                await _rewind(message)  # seek every partition of the batch back to its first record
                if not _cancelled():
                    await asyncio.sleep(retry_backoff_s)  # a failing batch is not retried in a hot loop
                raise
            await message.ack()  # the consumer's positions (end of this batch) committed

        consume.__name__ = consume.__qualname__ = getattr(handler, "__name__", "consume")
        consume.__doc__ = handler.__doc__
        kwargs: dict[str, Any] = {
            "group_id": prefix + group,
            "batch": True,
            "max_records": max_records,
            "ack_policy": AckPolicy.MANUAL,
            "auto_offset_reset": "earliest",
            "decoder": _decoder(prefix),
            **subscriber_kwargs,
        }
        broker.subscriber(*(prefix + t for t in topics), **kwargs)(consume)
        return handler

    return register


async def _rewind(message: Any) -> None:
    """FastStream's `KafkaAckableMessage.nack()`, also for the list of records TestKafkaBroker hands over
    (its nack expects a tuple): each partition of the batch is sought back to its earliest record."""
    if not message.committed:
        raw = message.raw_message
        earliest: dict[TopicPartition, int] = {}
        for r in raw if isinstance(raw, tuple | list) else (raw,):
            tp = TopicPartition(r.topic, r.partition)
            offset: int = r.offset
            earliest[tp] = min(offset, earliest.get(tp, offset))
        for tp, offset in earliest.items():
            message.consumer.seek(partition=tp, offset=offset)
    await StreamMessage.nack(message)  # marks it nacked (no second seek)


def _cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def asyncapi(broker: KafkaBroker, *, title: str, version: str = "1.0.0", description: str = "") -> dict[str, Any]:
    """The consumer's AsyncAPI 3.0 document (its subscriptions and their typed payloads)."""
    spec = AsyncAPI(broker, title=title, version=version, description=description, schema_version="3.0.0")
    return json.loads(spec.to_specification().to_json())


__all__ = [
    "EnvelopeMeta",
    "PgInbox",
    "asyncapi",
    "decode_records",
    "event_subscriber",
    "event_union",
    "meta",
]
