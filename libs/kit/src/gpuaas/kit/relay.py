"""The outbox relay: publishes committed outbox rows in order, then marks them sent.

- One active relay per service: a session-level advisory lock held on a dedicated connection;
  other replicas stand by and take over when the holder dies.
- Wake-up by LISTEN/NOTIFY (trigger on insert), with polling as the safety net.
- Rows are claimed with FOR UPDATE (waiting, not SKIP LOCKED) in `seq` order, published with acks=all, and
  marked sent in the same transaction. Waiting matters with replicas: a deposed leader (its lock connection
  lost mid-batch) still holds its batch's rows, and a new leader that skipped them would publish later
  events of the same aggregates first; it waits instead, then sees those rows sent (or, if that batch
  rolled back, publishes them itself, in order). A crash between publish and mark re-publishes the batch; consumers
  dedupe by event id (inbox), so effects stay exactly-once.
- Sent rows are kept for `retention_hours` so a range can be replayed after a broker loss.
- With a `signer`, the envelopes of the signed topics (gpuaas.kit.event_signing.SIGNED_TOPICS) are signed on
  their way out: the key never leaves the relay's process and a replayed row is signed again with the current key.
"""

# aiokafka and asyncpg ship no type information, so what this module gets back from them is unknown to the
# checker: it does not report those unknowns here (what the module itself exports is annotated).
# pyright: reportMissingTypeStubs=false, reportUnknownMemberType=false
# pyright: reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import zlib
from datetime import datetime, timedelta

import asyncpg
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from sqlalchemy import delete, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gpuaas.kit.db import rows_affected
from gpuaas.kit.event_signing import SIGNED_TOPICS, EventSigner
from gpuaas.kit.logging import get_logger
from gpuaas.kit.metrics import ServiceMetrics
from gpuaas.kit.tables import outbox

log = get_logger(__name__)

# Fault injection for the crash-between-publish-and-mark test: the relay SIGKILLs its own
# process right after the broker acknowledged a batch of at least N rows (the variable's value) and
# before the rows are marked sent. The size keeps the few events a service may still have pending when it
# restarts from setting it off before the test's own batch.
FAULT_KILL_AFTER_PUBLISH = "GPUAAS_FAULT_RELAY_KILL_AFTER_PUBLISH"


MARK_SENT = text("UPDATE outbox SET sent_at = now() WHERE seq = ANY(CAST(:seqs AS bigint[]))")

# A leader whose host vanished (no FIN, no RST) would keep its advisory lock, and with it the leadership, until the
# server's TCP keepalive gave up on the connection (2 h by default). Probing the lock connection after 10 s idle,
# every 5 s, 3 times, hands the lock to a standby replica within about half a minute.
LOCK_SESSION_SETTINGS = {"tcp_keepalives_idle": "10", "tcp_keepalives_interval": "5", "tcp_keepalives_count": "3"}
# The batch transaction of such a leader holds its rows' locks, which its successor waits for (never SKIP LOCKED:
# see the module doc); the server ends a transaction left idle this long beyond the publish deadline.
BATCH_IDLE_MARGIN_S = 30


def advisory_key(schema: str) -> int:
    return zlib.crc32(f"gpuaas-relay:{schema}".encode())


class OutboxRelay:
    def __init__(
        self,
        *,
        schema: str,
        engine: AsyncEngine,
        sessions: async_sessionmaker[AsyncSession],
        producer: AIOKafkaProducer,
        dsn: str,
        metrics: ServiceMetrics,
        batch_size: int = 500,
        poll_interval_s: float = 1.0,
        retention_hours: int = 168,
        publish_timeout_s: float = 60.0,
        topic_prefix: str = "",
        signer: EventSigner | None = None,
    ) -> None:
        self.schema = schema
        self.signer = signer
        self.engine = engine
        self.sessions = sessions
        self.producer = producer
        self.dsn = dsn
        self.metrics = metrics
        self.batch_size = batch_size
        self.poll_interval_s = poll_interval_s
        self.retention = timedelta(hours=retention_hours)
        self.publish_timeout_s = publish_timeout_s
        self.topic_prefix = topic_prefix
        self.kill_after_publish_rows = int(os.environ.get(FAULT_KILL_AFTER_PUBLISH) or 0)  # 0: no fault
        self.is_leader = False
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        """Stand by until this replica holds the relay lock, then publish until stopped."""
        while not self._stopping.is_set():
            lock_conn: asyncpg.Connection | None = None
            try:
                conn: asyncpg.Connection = await asyncpg.connect(
                    self.dsn, server_settings=LOCK_SESSION_SETTINGS | {"search_path": self.schema}
                )
                lock_conn = conn
                if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", advisory_key(self.schema)):
                    await self._sleep(2.0)
                    continue
                self.is_leader = True
                self.metrics.relay_leader.set(1)
                await conn.add_listener(f"{self.schema}_outbox", self._on_notify)
                log.info("relay_leader", schema=self.schema)
                await self._publish_loop(conn)
            except (OSError, asyncpg.PostgresError, ConnectionError) as exc:
                log.warning("relay_db_error", error=str(exc))
                self.metrics.relay_restarts.inc()
                await self._sleep(1.0)
            except (KafkaError, TimeoutError) as exc:
                # The broker failed (or did not acknowledge in time) a batch: its transaction rolled back, the
                # rows stay unsent and are published again; consumers dedupe whatever had reached the broker.
                log.warning("relay_publish_failed", error=f"{type(exc).__name__}: {exc}")
                self.metrics.relay_restarts.inc()
                await self._sleep(1.0)
            except Exception:  # never let the relay task die silently: nothing would publish until a restart
                log.exception("relay_failed")
                self.metrics.relay_restarts.inc()
                await self._sleep(1.0)
            finally:
                self.is_leader = False
                self.metrics.relay_leader.set(0)
                if lock_conn is not None and not lock_conn.is_closed():
                    try:
                        await asyncio.wait_for(lock_conn.close(), 5)
                    except (TimeoutError, OSError, asyncpg.PostgresError):
                        lock_conn.terminate()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def _on_notify(self, *_: object) -> None:
        self._wake.set()

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass

    async def _publish_loop(self, lock_conn: asyncpg.Connection) -> None:
        last_prune = 0.0
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            if lock_conn.is_closed():
                raise ConnectionError("relay lock connection lost")
            self._wake.clear()
            published = await self.publish_batch()
            if loop.time() - last_prune > 300:
                await self.prune()
                last_prune = loop.time()
            if published >= self.batch_size:
                continue  # more waiting: no sleep
            await self._update_lag()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval_s):  # not wait_for: it can swallow a cancel on 3.11
                    await self._wake.wait()

    async def publish_batch(self) -> int:
        """Publish one batch of unsent rows in `seq` order; return how many were published."""
        async with self.sessions() as session, session.begin():
            idle_ms = int((self.publish_timeout_s + BATCH_IDLE_MARGIN_S) * 1000)
            await session.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = {idle_ms}"))
            rows = (
                await session.execute(
                    select(
                        outbox.c.seq,
                        outbox.c.topic,
                        outbox.c.aggregate_id,
                        outbox.c.payload,
                        outbox.c.event_id,
                        outbox.c.event_type,
                        outbox.c.headers,
                    )
                    .where(outbox.c.sent_at.is_(None))
                    .order_by(outbox.c.seq)
                    .limit(self.batch_size)
                    # Not skip_locked: never overtake rows another relay is publishing (see the module doc).
                    .with_for_update()
                )
            ).all()
            if not rows:
                return 0
            futures = []
            for r in rows:
                headers = [("event_id", str(r.event_id).encode()), ("event_type", r.event_type.encode())]
                if cid := (r.headers or {}).get("correlation_id"):
                    headers.append(("correlation_id", cid.encode()))
                # Only the topics consumers verify are signed: ~50 µs an event is not worth paying on the others.
                signed = self.signer is not None and r.topic in SIGNED_TOPICS
                payload = self.signer.sign_payload(r.payload) if signed and self.signer else r.payload
                futures.append(
                    await self.producer.send(
                        self.topic_prefix + r.topic, payload, key=r.aggregate_id.encode(), headers=headers
                    )
                )
            # acks=all: every record of the batch is durable on the broker before we mark it.
            await asyncio.wait_for(asyncio.gather(*futures), self.publish_timeout_s)
            if self.kill_after_publish_rows and len(rows) >= self.kill_after_publish_rows:
                log.warning("fault_injection_kill_after_publish", rows=len(rows))
                os.kill(os.getpid(), signal.SIGKILL)
            # One statement of one shape whatever the batch size (an IN list renders anew for every size).
            await session.execute(MARK_SENT, {"seqs": [r.seq for r in rows]})
        for r in rows:
            self.metrics.events_published.labels(r.topic).inc()
        return len(rows)

    async def prune(self) -> int:
        async with self.sessions() as session, session.begin():
            result = await session.execute(
                delete(outbox).where(outbox.c.sent_at.is_not(None), outbox.c.sent_at < func.now() - self.retention)
            )
        return rows_affected(result)

    async def _update_lag(self) -> None:
        async with self.sessions() as session:
            count, oldest, at = (
                await session.execute(
                    select(func.count(), func.min(outbox.c.created_at), func.now()).where(outbox.c.sent_at.is_(None))
                )
            ).one()
        self.metrics.set_outbox_lag(count, oldest, at)


async def replay(sessions: async_sessionmaker[AsyncSession], since: datetime, until: datetime | None = None) -> int:
    """Mark rows *published* in [since, until) unsent, so the relay publishes them again in order.

    Used after a broker lost its log: what matters is when a row reached that broker, not when it was
    created (a row created earlier may have been published to it later). Consumers dedupe by event id,
    so replaying too much is safe.
    """
    async with sessions() as session, session.begin():
        stmt = update(outbox).where(outbox.c.sent_at >= since)
        if until is not None:
            stmt = stmt.where(outbox.c.sent_at < until)
        result = await session.execute(stmt.values(sent_at=None))
    return rows_affected(result)
