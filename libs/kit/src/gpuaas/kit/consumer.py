"""The service's consumer: one group per service, one subscriber for all its topics.

Exactly-once effects on an at-least-once broker:
- each message is applied in a savepoint of the batch's transaction, together with its inbox row
  `(consumer, event_id)`; a redelivered event finds its inbox row and is skipped;
- offsets are committed only after the database commit (with a timeout: a commit against a restarted
  Tansu retries forever otherwise);
- a handler that fails `max_attempts` times, or a message that cannot be parsed, is parked in
  `dead_letters` (with an inbox row, so redelivery does not re-run it) and the batch goes on;
- if the transaction itself fails (database down), nothing is committed and the partitions are
  rewound to the batch start;
- events of a signed topic (gpuaas.kit.event_signing.SIGNED_TOPICS: every topic that changes access or
  money) are applied only from a source the contracts allow for that type (gpuaas.contracts.emitters) with
  that source's valid signature; anything else is parked with the reason (no inbox row, so a forged copy
  cannot claim a genuine event's id).
"""

# aiokafka and asyncpg ship no type information, so what this module gets back from them is unknown to the
# checker: it does not report those unknowns here (what the module itself exports is annotated).
# pyright: reportMissingTypeStubs=false, reportUnknownMemberType=false
# pyright: reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.contracts import TOPICS, Event, new_event_id
from gpuaas.kit import context
from gpuaas.kit.bulk import insert_rows
from gpuaas.kit.event_signing import SIGNED_TOPICS, EventVerifier, SignatureError
from gpuaas.kit.logging import get_logger
from gpuaas.kit.metrics import ServiceMetrics
from gpuaas.kit.subscriptions import Handler, Subscriptions
from gpuaas.kit.tables import dead_letters, inbox

log = get_logger(__name__)


T = TypeVar("T")
# A record as the broker hands it over: raw key and value bytes (either may be absent).
Record = ConsumerRecord[bytes | None, bytes | None]


async def bounded(aw: Awaitable[T], timeout_s: float) -> T:
    """Await an aiokafka call with a deadline that holds. `asyncio.wait_for` waits for the cancelled call to
    finish unwinding, and an aiokafka client whose broker went away can take forever to do that (seen: a
    consumer stuck in stop()/start() after a broker outage, its service never ready again). Here the call
    is cancelled and left behind, and TimeoutError is raised at the deadline."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_forget)
        raise TimeoutError(f"no answer from the broker client in {timeout_s}s")
    return task.result()


def _forget(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: an abandoned call's late error is not an unhandled-exception warning


class EventConsumer:
    def __init__(
        self,
        *,
        name: str,
        bootstrap: str,
        subscriptions: Subscriptions,
        sessions: async_sessionmaker[AsyncSession],
        metrics: ServiceMetrics,
        batch_size: int = 500,
        max_attempts: int = 3,
        session_timeout_ms: int = 6000,
        heartbeat_interval_ms: int = 1000,
        commit_timeout_s: float = 10.0,
        stall_check_s: float = 20.0,
        broker_timeout_s: float = 60.0,
        group_id: str | None = None,
        topic_prefix: str = "",
        security: Mapping[str, Any] | None = None,
        verifier: EventVerifier | None = None,
    ) -> None:
        self.name = name
        # Public keys of the producers of signed topics; without one, their events are all parked.
        self.verifier = verifier or EventVerifier()
        self.topic_prefix = topic_prefix
        # TLS/SASL keyword arguments of the client (gpuaas.kit.kafka.client_security); empty: PLAINTEXT.
        self.security = dict(security or {})
        # Both on the wire under the deployment's prefix; the inbox, handlers and metrics see logical names.
        self.group_id = topic_prefix + (group_id or name)
        self.bootstrap = bootstrap
        self.subs = subscriptions
        self.sessions = sessions
        self.metrics = metrics
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self.session_timeout_ms = session_timeout_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.commit_timeout_s = commit_timeout_s
        self.stall_check_s = stall_check_s
        self.broker_timeout_s = broker_timeout_s
        self._polling = False
        self._commit: asyncio.Future[Any] | None = None  # the offset commit in flight
        self.consumer: AIOKafkaConsumer | None = None
        self._stopping = asyncio.Event()

    def logical(self, wire_topic: str) -> str:
        """The registry's name of a topic read from the broker (without the deployment's prefix)."""
        return wire_topic.removeprefix(self.topic_prefix)

    @property
    def assigned(self) -> bool:
        """Ready only while the poll loop runs with partitions: a consumer task that left its loop keeps a
        stale assignment in aiokafka, which must not read as healthy."""
        return self._polling and bool(self.consumer and self.consumer.assignment())

    def stop(self) -> None:
        self._stopping.set()

    def _shutting_down(self) -> bool:
        """A CancelledError is ours (stop() or the task cancelled) rather than aiokafka's own."""
        task = asyncio.current_task()
        return self._stopping.is_set() or (task is not None and task.cancelling() > 0)

    async def _pause(self, seconds: float) -> None:
        """Back off, but wake at once for stop()."""
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass

    async def run(self) -> None:
        """Poll until stop(); any failure (broker, a wedged client, an aiokafka-internal cancellation, a bug)
        ends with a fresh consumer after a back-off: this task must never die while the service runs. The
        outer loop is the last guard: whatever escapes the client loop (even from closing a client) starts it
        again."""
        if not self.subs.topics:
            return
        while not self._stopping.is_set():
            try:
                await self._run_clients()
            except asyncio.CancelledError:
                if self._shutting_down():
                    raise
                log.warning("consumer_task_cancelled_internally")
            except Exception:
                log.exception("consumer_task_crashed")
            self._polling = False
            await self._pause(1.0)

    async def _run_clients(self) -> None:
        topics = sorted(self.topic_prefix + t for t in self.subs.topics)
        backoff = 1.0
        while not self._stopping.is_set():
            self.consumer = AIOKafkaConsumer(
                *topics,
                bootstrap_servers=self.bootstrap,
                group_id=self.group_id,
                client_id=f"{self.name}-consumer",
                enable_auto_commit=False,
                # Tansu's end offsets are wrong: new groups start at the beginning; the inbox dedupes.
                auto_offset_reset="earliest",
                session_timeout_ms=self.session_timeout_ms,
                heartbeat_interval_ms=self.heartbeat_interval_ms,
                max_poll_records=self.batch_size,
                fetch_max_wait_ms=200,
                **self.security,
            )
            try:
                await bounded(self.consumer.start(), self.broker_timeout_s)
                self._polling = True
                backoff = 1.0  # joined: the next failure starts the back-off afresh
                await self._loop()
            except asyncio.CancelledError:
                if self._shutting_down():
                    raise
                # aiokafka cancelled a future we were awaiting (its coordinator closing under us): not our
                # shutdown, so rejoin instead of letting the task end silently with a stale assignment.
                log.warning("consumer_cancelled_internally")
            except (KafkaError, TimeoutError) as exc:
                log.warning("consumer_broker_error", error=f"{type(exc).__name__}: {exc}")
            except Exception:
                log.exception("consumer_crashed")
            finally:
                self._polling = False
                # Always stop(): cancelling inside getmany without it stalls partitions (aiokafka bug).
                try:
                    await bounded(self.consumer.stop(), 10)
                except asyncio.CancelledError:
                    if self._shutting_down():
                        raise
                    # aiokafka cancelled its own stop(): the old client is dropped either way.
                    log.warning("consumer_stop_cancelled_internally")
                except Exception as exc:  # whatever the old client raises while closing, a new one follows
                    log.warning("consumer_stop_failed", error=f"{type(exc).__name__}: {exc}")
            self.metrics.consumer_restarts.inc()
            await self._pause(backoff)
            backoff = min(backoff * 2, 30.0)

    async def _loop(self) -> None:
        assert self.consumer is not None
        loop = asyncio.get_running_loop()
        last_records = last_check = loop.time()
        try:
            await self._poll(loop, last_records, last_check)
        finally:
            await self._settle_commit(quiet=True)  # let the last offsets reach the broker before stop()

    async def _poll(self, loop: asyncio.AbstractEventLoop, last_records: float, last_check: float) -> None:
        assert self.consumer is not None
        while not self._stopping.is_set():
            # Bounded: a getmany that never returns is a wedged client, answered by a fresh one.
            batch = await bounded(
                self.consumer.getmany(timeout_ms=500, max_records=self.batch_size), self.broker_timeout_s
            )
            if not batch:
                await self._settle_commit()
                if await self._update_lag() == 0:
                    self._progressed()
                now = loop.time()
                if now - last_records > self.stall_check_s and now - last_check > self.stall_check_s:
                    last_check = now
                    await self._check_stalled()
                continue
            last_records = loop.time()
            records = [r for msgs in batch.values() for r in msgs]
            try:
                await self.apply(records)
            except Exception as exc:  # the database is down or the transaction failed as a whole
                log.warning("consumer_batch_failed", error=str(exc), records=len(records))
                for tp, msgs in batch.items():
                    self.consumer.seek(tp, msgs[0].offset)
                await asyncio.sleep(1.0)
                continue
            self._progressed()
            offsets = {tp: msgs[-1].offset + 1 for tp, msgs in batch.items()}
            # The offsets go to the broker while the next batch is fetched and applied (one commit in flight at
            # a time, in order; always after the database commit). A failed commit is seen before the next one.
            await self._settle_commit()
            self._commit = asyncio.ensure_future(bounded(self.consumer.commit(offsets), self.commit_timeout_s))
            await self._update_lag()

    async def _settle_commit(self, *, quiet: bool = False) -> None:
        """Wait for the offset commit in flight, if any. A failure is not fatal (redelivery is deduped by the
        inbox) but the client rejoins to resync with the broker, unless `quiet` (the client is closing)."""
        commit, self._commit = self._commit, None
        if commit is None:
            return
        try:
            await commit
        except Exception as exc:  # TimeoutError, KafkaError, or whatever the client raised
            log.warning("consumer_commit_failed", error=f"{type(exc).__name__}: {exc}")
            if not quiet:
                raise KafkaError(f"offset commit failed: {exc}") from exc
        except asyncio.CancelledError:
            if not quiet or self._shutting_down():
                raise

    async def _check_stalled(self) -> None:
        """Watchdog: after a broker outage an aiokafka consumer can keep its assignment yet never fetch
        again (seen on Apache Kafka after a broker restart). If an assigned partition has records past our
        position while nothing arrived for `stall_check_s`, raise so that run() rejoins with a new consumer.
        (Tansu under-reports end offsets, which can only hide a stall, never invent one.)"""
        assert self.consumer is not None
        assigned = list(self.consumer.assignment())
        if not assigned:
            return
        try:
            ends = await bounded(self.consumer.end_offsets(assigned), 10)
        except (TimeoutError, KafkaError) as exc:  # the broker is away: nothing to tell yet
            log.info("consumer_stall_check_failed", error=str(exc))
            return
        behind: dict[str, int | str] = {}
        for tp in assigned:
            try:
                pos = await bounded(self.consumer.position(tp), 10)
            except TimeoutError:  # the broker answers, yet our position never resolves: wedged
                behind[f"{tp.topic}/{tp.partition}"] = "position unknown"
                continue
            if ends.get(tp, 0) > pos:
                behind[f"{tp.topic}/{tp.partition}"] = ends[tp] - pos
        if behind:
            log.warning("consumer_stalled", behind=behind)
            raise KafkaError(f"consumer stalled: records waiting on {behind} but none fetched")

    def _progressed(self) -> None:
        """The consumer applied a batch or has nothing waiting: `gpuaas_consumer_last_progress_timestamp_seconds`
        moves on (a consumer that holds partitions yet never fetches, or never joins, lets it age)."""
        self.metrics.consumer_progress.labels(self.group_id).set(time.time())

    async def _update_lag(self) -> int | None:
        """Lag from the fetch high-water mark (Tansu's end_offsets are wrong); the total, None when unknown."""
        if self.consumer is None:
            return None
        total: int | None = 0
        for tp in self.consumer.assignment():
            hw = self.consumer.highwater(tp)
            if hw is None:
                continue
            try:  # position() waits for committed offsets: unbounded while the coordinator is away
                pos = await bounded(self.consumer.position(tp), 2)
            except TimeoutError:
                total = None
                continue
            lag = max(hw - pos, 0)
            self.metrics.consumer_lag.labels(self.logical(tp.topic), str(tp.partition)).set(lag)
            if total is not None:
                total += lag
        return total

    async def apply(self, records: Sequence[Record]) -> None:
        """Apply a batch in one transaction.

        Fast path: one bulk inbox claim for the batch, then every handler inside a single savepoint.
        If any handler fails, that savepoint is rolled back and the batch's claimed events are applied
        one savepoint each, retried and parked as needed (the slow path isolates the poisoned event).
        """
        async with self.sessions() as session, session.begin():
            pending: list[tuple[Record, Event, Sequence[Handler]]] = []
            seen: set[uuid.UUID] = set()
            for record in records:
                topic = TOPICS.get(self.logical(record.topic))
                try:
                    if topic is None:
                        raise ValueError(f"unknown topic {record.topic}")
                    if record.value is None:
                        raise ValueError("a message without a value")
                    event = topic.parse(record.value)
                except Exception as exc:  # parsing has no effects: whatever it raises (ValidationError, a
                    # RecursionError for deep nesting, ...) parks this one record instead of failing the batch
                    await self._park(session, record, None, None, f"malformed event: {exc}", attempts=1)
                    continue
                if event is not None and topic.name in SIGNED_TOPICS:
                    try:
                        self.verifier.verify(topic.name, json.loads(record.value))
                    except SignatureError as exc:
                        await self._park(session, record, event.id, event.type, f"rejected: {exc}", attempts=1)
                        continue
                if event is None:
                    continue  # a type this version does not know: ignored by contract
                handlers = self.subs.handlers.get(event.type)
                if not handlers:
                    continue
                if event.id in seen:  # the same event twice in one batch (e.g. a replay)
                    self.metrics.events_duplicate.labels(self.logical(record.topic)).inc()
                    continue
                seen.add(event.id)
                pending.append((record, event, handlers))
            if not pending:
                return
            # One statement of a fixed shape for the whole batch (unnest of arrays): compiled and prepared once.
            claimed = {
                row.event_id
                for row in await insert_rows(
                    session,
                    inbox,
                    [
                        {
                            "consumer": self.name,
                            "event_id": e.id,
                            "event_type": e.type,
                            "topic": self.logical(r.topic),
                            "partition": r.partition,
                            "offset": r.offset,
                        }
                        for r, e, _ in pending
                    ],
                    on_conflict_do_nothing=True,
                    returning=("event_id",),
                )
            }
            fresh = [(r, e, h) for r, e, h in pending if e.id in claimed]
            for r, e, _ in pending:
                if e.id not in claimed:
                    self.metrics.events_duplicate.labels(self.logical(r.topic)).inc()
            try:
                async with session.begin_nested():
                    await self._run_batch(session, [(e, h) for _, e, h in fresh])
            except Exception as exc:  # some handler failed: isolate it event by event
                log.info("batch_fast_path_failed", error=f"{type(exc).__name__}: {exc}", events=len(fresh))
                for record, event, handlers in fresh:
                    await self._apply_isolated(session, record, event, handlers)
                return
            for record, event, _ in fresh:
                self.metrics.events_applied.labels(self.logical(record.topic), event.type).inc()

    async def _run_batch(self, session: AsyncSession, events: list[tuple[Event, Sequence[Handler]]]) -> None:
        """Every event's handlers in order; consecutive events taken by one batch handler go in one call."""
        i = 0
        while i < len(events):
            event, handlers = events[i]
            batch_fn = self.subs.batch.get(event.type)
            if batch_fn is None:
                await run_handlers(session, event, handlers)
                i += 1
                continue
            j = i + 1
            while j < len(events) and self.subs.batch.get(events[j][0].type) is batch_fn:
                j += 1
            await batch_fn(session, [e for e, _ in events[i:j]])
            i = j

    async def _apply_isolated(
        self, session: AsyncSession, record: Record, event: Event, handlers: Sequence[Handler]
    ) -> None:
        error = ""
        for attempt in range(1, self.max_attempts + 1):
            try:
                async with session.begin_nested():
                    await run_handlers(session, event, handlers)
                self.metrics.events_applied.labels(self.logical(record.topic), event.type).inc()
                return
            except Exception as exc:  # a handler bug or a rule violation: retry, then park
                error = f"{type(exc).__name__}: {exc}"
                log.warning("handler_failed", event_id=str(event.id), type=event.type, attempt=attempt, error=error)
        await self._park(session, record, event.id, event.type, error, attempts=self.max_attempts)

    async def _park(
        self,
        session: AsyncSession,
        record: Record,
        event_id: uuid.UUID | None,
        event_type: str | None,
        error: str,
        attempts: int,
    ) -> None:
        await session.execute(
            insert(dead_letters).values(
                id=new_event_id(),
                consumer=self.name,
                event_id=event_id,
                event_type=event_type,
                topic=self.logical(record.topic),
                partition=record.partition,
                offset=record.offset,
                key=record.key,
                payload=record.value if isinstance(record.value, bytes) else json.dumps(record.value).encode(),
                error=error[:4000],
                attempts=attempts,
            )
        )
        self.metrics.dead_lettered.labels(self.logical(record.topic)).inc()
        log.error("event_dead_lettered", topic=self.logical(record.topic), offset=record.offset, error=error[:500])


async def run_handlers(session: AsyncSession, event: Event, handlers: Sequence[Handler]) -> None:
    with context.bound(correlation=event.correlation_id, causation=event.id, event_type=event.type):
        for handler in handlers:
            await handler(session, event)


async def count_parked(session: AsyncSession) -> int:
    return (
        await session.execute(select(func.count()).select_from(dead_letters).where(dead_letters.c.status == "parked"))
    ).scalar_one()


__all__ = ["EventConsumer", "TopicPartition", "count_parked", "run_handlers"]
