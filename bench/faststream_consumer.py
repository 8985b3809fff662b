"""Can the platform's consumers run on FastStream 0.7? The kit consumer's guarantees built on FastStream's
batch subscriber with manual acknowledgement, measured against the kit consumer in the same run.

Both implementations do the same database work: `gpuaas.kit.consumer.EventConsumer.apply(records)` (one
transaction per fetched batch: inbox claim, handlers, dead letters) with a batch handler that stores each
audit event as a row. Only the consumer loop differs:

- kit: the service's own aiokafka loop (`EventConsumer.run()`: getmany, apply, commit the batch's offsets,
  rewind + back-off on a failed transaction, bounded broker calls, stall watchdog, rejoin);
- faststream: `KafkaBroker.subscriber(topic, batch=True, max_records=500, ack_policy=AckPolicy.MANUAL)`,
  the handler calls `apply(message.raw_message)`, then `message.ack()` (commits the consumer's positions,
  i.e. the end of the batch); on an exception it seeks each partition back to the batch's first record,
  sleeps 1 s and re-raises (FastStream logs it and fetches again).

Each consumer runs as its own process (`worker`), as a service would. Phases, per broker:

1. throughput: N audit events put on a fresh 4-partition topic, then each implementation drains it in its
   own group (rounds alternate the order); events/s = rows / (last stored_at - first stored_at); then the
   same with both running at once on one backlog ("paired": the same contention for both, a steadier
   ratio on a shared machine);
2. guarantees, each implementation on a fresh topic of N events:
   - rewind: the first `apply` of the worker raises after writing (the transaction rolls back);
   - SIGKILL mid-stream, restart: every event applied exactly once (rows == inbox rows == N, no duplicate);
   - bounded shutdown: SIGTERM during a backlog, time to exit;
   - one group across topics: one subscriber of two topics, the group's members assigned both;
   - with `--broker kafka` (Apache Kafka started here): the broker SIGKILLed mid-stream, down 30 s, started
     again: does the consumer resume by itself, every event applied once?

    uv run python bench/faststream_consumer.py [--events 20000] [--rounds 2] [--broker tansu|kafka]

Broker: Tansu (embedded) unless GPUAAS_KAFKA_BOOTSTRAP names one (`make test-kafka`'s Apache Kafka);
Postgres: embedded unless GPUAAS_DATABASE_URL (superuser). Writes bench/results/faststream_consumer.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Actor, Event, new_event_id
from gpuaas.contracts.events.audit import AuditRecord, AuditRecorded
from gpuaas.contracts.events.usage import UsageRecorded
from gpuaas.contracts.registry import AUDIT, USAGE
from gpuaas.contracts.testing import sample_event
from gpuaas.kit.consumer import EventConsumer
from gpuaas.kit.db import create_engine, session_factory, to_plain_url
from gpuaas.kit.metrics import ServiceMetrics
from gpuaas.kit.subscriptions import Subscriptions
from gpuaas.kit.tables import dead_letters, inbox, kit_metadata

RESULTS = Path(__file__).parent / "results"
BENCH_EVENTS: dict[str, type[Event]] = {AUDIT: AuditRecorded, USAGE: UsageRecorded}
SCHEMA = "bench_consumer"
ROWS_DDL = f"""CREATE TABLE IF NOT EXISTS {SCHEMA}.rows (
    consumer text NOT NULL, event_id uuid NOT NULL, resource_id text NOT NULL,
    stored_at timestamptz NOT NULL DEFAULT clock_timestamp(), PRIMARY KEY (consumer, event_id))"""


# ---------------------------------------------------------------- the worker (one consumer process)


FAIL_FIRST = {"armed": False}


def subscriptions(consumer: str, topics: list[str]) -> Subscriptions:
    """One batch handler per topic's bench event: a row per event (what identity's audit store does)."""
    subs = Subscriptions()

    async def store(session: AsyncSession, events: list[Any]) -> None:
        if FAIL_FIRST["armed"]:  # the database connection dies mid-batch: the whole transaction fails
            FAIL_FIRST["armed"] = False
            await session.execute(
                text("INSERT INTO rows (consumer, event_id, resource_id) VALUES ('x', gen_random_uuid(), 'x')")
            )
            await session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
        await session.execute(
            text("INSERT INTO rows (consumer, event_id, resource_id) VALUES (:c, :e, :r)"),
            [{"c": consumer, "e": e.id, "r": e.subject} for e in events],
        )

    for t in topics:
        subs.on_batch(BENCH_EVENTS[t])(store)
    return subs


async def worker(args: argparse.Namespace) -> None:
    engine = create_engine(args.db, SCHEMA, pool_size=2)
    sessions = session_factory(engine)
    FAIL_FIRST["armed"] = args.fail_first
    kit = EventConsumer(
        name=args.consumer,
        bootstrap=args.bootstrap,
        subscriptions=subscriptions(args.consumer, args.topics),
        sessions=sessions,
        metrics=ServiceMetrics(args.consumer),
        group_id=args.group,
        batch_size=500,
        topic_prefix=args.prefix,
    )
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    if args.impl == "kit":
        task = asyncio.create_task(kit.run())
        await stopping.wait()
        kit.stop()
        await asyncio.wait_for(task, 30)
    else:
        from faststream import AckPolicy
        from faststream.kafka import KafkaBroker
        from faststream.kafka.annotations import KafkaMessage
        from faststream.message import StreamMessage

        # Per-batch "Received/Processed" lines at DEBUG: the kit logs nothing per batch either.
        broker = KafkaBroker(args.bootstrap, graceful_timeout=10.0, log_level=logging.DEBUG)

        async def raw(msg: StreamMessage[Any]) -> Any:  # no JSON decode in FastStream: apply() parses
            return msg.body

        @broker.subscriber(
            *(args.prefix + t for t in args.topics),
            group_id=args.prefix + args.group,
            batch=True,
            max_records=500,
            ack_policy=AckPolicy.MANUAL,
            auto_offset_reset="earliest",
            session_timeout_ms=6000,
            heartbeat_interval_ms=1000,
            fetch_max_wait_ms=200,
            decoder=raw,
        )
        async def consume(body: Any, message: KafkaMessage) -> None:
            records = message.raw_message
            try:
                await kit.apply(records)  # the kit's transaction: inbox, handlers, dead letters
            except Exception:
                earliest: dict[TopicPartition, int] = {}
                for r in records:
                    tp = TopicPartition(r.topic, r.partition)
                    earliest[tp] = min(r.offset, earliest.get(tp, r.offset))
                for tp, offset in earliest.items():
                    message.consumer.seek(partition=tp, offset=offset)
                await StreamMessage.nack(message)
                await asyncio.sleep(1.0)
                raise
            await message.ack()

        await broker.start()
        await stopping.wait()
        await broker.stop()
    await engine.dispose()


# ---------------------------------------------------------------- the orchestrator


def events(topic: str, run: str, n: int) -> list[bytes]:
    if topic == USAGE:
        sample = sample_event(UsageRecorded)
        return [sample.model_copy(update={"id": new_event_id()}).model_dump_json().encode() for _ in range(n)]
    return [
        AuditRecorded.build(
            subject=f"{run}-{i % 64}",
            source="bench",
            actor=Actor.system("bench"),
            data=AuditRecord(
                service=run,
                action="bench.write",
                resource_type="probe",
                resource_id=str(i),
                after={"i": i, "pad": "x" * 200},
            ),
        )
        .model_dump_json()
        .encode()
        for i in range(n)
    ]


class Bench:
    def __init__(self, db: str, bootstrap: str, n: int, kafka: Any = None) -> None:
        self.db, self.bootstrap, self.n = db, bootstrap, n
        self.kafka = kafka  # an ApacheKafka this run started (the outage check stops and starts it)
        self.procs: list[subprocess.Popen[bytes]] = []

    async def setup(self) -> None:
        conn = await asyncpg.connect(to_plain_url(self.db))
        await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA}; {ROWS_DDL}")
        await conn.close()
        engine = create_engine(self.db, SCHEMA, pool_size=1)
        async with engine.begin() as c:
            await c.run_sync(kit_metadata.create_all, tables=[inbox, dead_letters])
        await engine.dispose()

    async def topic(self, n: int | None = None, topics: tuple[str, ...] = (AUDIT,)) -> str:
        """A fresh prefix with `n` events on each of `topics` (4 partitions each); returns the prefix."""
        prefix = f"bench{uuid.uuid4().hex[:8]}."
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        await admin.create_topics([NewTopic(prefix + t, 4, 1) for t in topics])
        await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=5)
        await producer.start()
        for t in topics:
            for i, payload in enumerate(events(t, prefix, self.n if n is None else n)):
                await producer.send(prefix + t, payload, key=str(i % 64).encode())
        await producer.flush()
        await producer.stop()
        return prefix

    def start(
        self, impl: str, consumer: str, prefix: str, topics: tuple[str, ...] = (AUDIT,), *, fail_first: bool = False
    ) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            __file__,
            "worker",
            "--impl",
            impl,
            "--consumer",
            consumer,
            "--group",
            consumer,
            "--db",
            self.db,
            "--bootstrap",
            self.bootstrap,
            "--prefix",
            prefix,
            *(["--fail-first"] if fail_first else []),
            *topics,
        ]
        log = open(Path(tempfile.gettempdir()) / f"{consumer}.log", "wb")  # noqa: SIM115 - the child's log
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    async def count(self, consumer: str) -> tuple[int, int, int]:
        """(rows, distinct event ids among them, inbox rows) of a consumer."""
        conn = await asyncpg.connect(to_plain_url(self.db))
        try:
            r = await conn.fetchrow(
                f"""SELECT (SELECT count(*) FROM {SCHEMA}.rows WHERE consumer = $1) AS n,
                           (SELECT count(DISTINCT event_id) FROM {SCHEMA}.rows WHERE consumer = $1) AS d,
                           (SELECT count(*) FROM {SCHEMA}.inbox WHERE consumer = $1) AS i""",
                consumer,
            )
            return r["n"], r["d"], r["i"]
        finally:
            await conn.close()

    async def wait_rows(self, consumer: str, n: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while (await self.count(consumer))[0] < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{consumer}: {await self.count(consumer)} of {n}")
            await asyncio.sleep(0.2)

    async def rate(self, consumer: str) -> float:
        conn = await asyncpg.connect(to_plain_url(self.db))
        try:
            r = await conn.fetchrow(
                f"SELECT count(*) AS n, EXTRACT(EPOCH FROM max(stored_at) - min(stored_at)) AS s "
                f"FROM {SCHEMA}.rows WHERE consumer = $1",
                consumer,
            )
            return float(r["n"]) / max(float(r["s"]), 1e-6)
        finally:
            await conn.close()

    @staticmethod
    def stop(p: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 60) -> float:
        t = time.monotonic()
        p.send_signal(sig)
        p.wait(timeout_s)
        return time.monotonic() - t

    async def throughput(self, impl: str, topic: str) -> float:
        consumer = f"{impl}-{uuid.uuid4().hex[:6]}"
        p = self.start(impl, consumer, topic)
        await self.wait_rows(consumer, self.n)
        self.stop(p)
        rows, distinct, inbox_rows = await self.count(consumer)
        assert rows == distinct == inbox_rows == self.n, (impl, rows, distinct, inbox_rows)
        return await self.rate(consumer)

    async def throughput_paired(self, topic: str) -> dict[str, float]:
        """Both implementations at once on the same backlog (own groups): on a shared, noisy machine each
        sees the same contention, so their ratio is steadier than that of runs taken one after the other."""
        consumers = {impl: f"{impl}-pair-{uuid.uuid4().hex[:6]}" for impl in ("kit", "faststream")}
        procs = [self.start(impl, c, topic) for impl, c in consumers.items()]
        for c in consumers.values():
            await self.wait_rows(c, self.n)
        for p in procs:
            self.stop(p)
        for impl, c in consumers.items():
            assert await self.count(c) == (self.n, self.n, self.n), impl
        return {impl: await self.rate(c) for impl, c in consumers.items()}

    async def guarantees(self, impl: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        # rewind: the first batch's transaction fails; everything is applied once after the retry
        topic = await self.topic()
        consumer = f"{impl}-rewind-{uuid.uuid4().hex[:6]}"
        p = self.start(impl, consumer, topic, fail_first=True)
        await self.wait_rows(consumer, self.n)
        await asyncio.sleep(1.0)
        self.stop(p)
        leaked = (await self.count("x"))[0]  # the failed transaction's own write, rolled back with it
        out["rewind_exactly_once"] = await self.count(consumer) == (self.n, self.n, self.n) and leaked == 0
        # SIGKILL mid-stream, then a restart
        topic = await self.topic()
        consumer = f"{impl}-kill-{uuid.uuid4().hex[:6]}"
        p = self.start(impl, consumer, topic)
        while (seen := (await self.count(consumer))[0]) == 0:
            await asyncio.sleep(0.01)
        self.stop(p, signal.SIGKILL)
        seen = (await self.count(consumer))[0]
        p = self.start(impl, consumer, topic)
        await self.wait_rows(consumer, self.n)
        await asyncio.sleep(2.0)  # anything redelivered after the restart would show now
        self.stop(p)
        final = await self.count(consumer)
        out["kill"] = {"applied_before_kill": seen, "after_restart": final}
        out["kill_exactly_once"] = 0 < seen < self.n and final == (self.n, self.n, self.n)
        # bounded shutdown: SIGTERM while a backlog is being drained
        topic = await self.topic(self.n * 2)
        consumer = f"{impl}-stop-{uuid.uuid4().hex[:6]}"
        p = self.start(impl, consumer, topic)
        while (await self.count(consumer))[0] == 0:
            await asyncio.sleep(0.01)
        out["shutdown_s"] = round(self.stop(p), 2)
        out["shutdown_exit_code"] = p.returncode
        # one group across topics: both topics drained by one subscriber in one group
        prefix = await self.topic(500, (AUDIT, USAGE))
        consumer = f"{impl}-two-{uuid.uuid4().hex[:6]}"
        p = self.start(impl, consumer, prefix, (AUDIT, USAGE))
        await self.wait_rows(consumer, 1000)
        await asyncio.sleep(1.0)
        self.stop(p)
        out["one_group_two_topics"] = await self.count(consumer) == (1000, 1000, 1000)
        if self.kafka is not None:
            out["broker_outage"] = await self.outage(impl)
        return out

    async def outage(self, impl: str, down_s: float = 30.0) -> dict[str, Any]:
        """The broker SIGKILLed mid-stream and started again after `down_s` (Apache Kafka keeps its log):
        does the consumer resume by itself, and is every event applied once?"""
        topic = await self.topic()
        consumer = f"{impl}-outage-{uuid.uuid4().hex[:6]}"
        p = self.start(impl, consumer, topic)
        while (await self.count(consumer))[0] == 0:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(self.kafka.kill)
        before = (await self.count(consumer))[0]
        await asyncio.sleep(down_s)
        await asyncio.to_thread(self.kafka.start)
        back = time.monotonic()
        try:
            await self.wait_rows(consumer, self.n, timeout_s=180)
            recovered_s: float | None = round(time.monotonic() - back, 1)
        except TimeoutError:
            recovered_s = None
        await asyncio.sleep(2.0)
        self.stop(p)
        final = await self.count(consumer)
        return {
            "down_s": down_s,
            "applied_before": before,
            "recovered_after_restart_s": recovered_s,
            "final": final,
            "exactly_once": recovered_s is not None and final == (self.n, self.n, self.n),
        }

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


async def main(n: int, rounds: int, broker: str = "tansu") -> None:
    from gpuaas.devstack.infra import EmbeddedPostgres, Tansu, free_port

    root = Path(tempfile.mkdtemp(prefix="gpuaas-fsbench-"))
    root.chmod(0o755)
    pg = tansu = None
    db = os.environ.get("GPUAAS_DATABASE_URL")
    if not db:
        pg = EmbeddedPostgres(root / "pg", port=free_port())
        pg.start()
        db = pg.admin_url
    bootstrap = os.environ.get("GPUAAS_KAFKA_BOOTSTRAP")
    broker_name = "external (GPUAAS_KAFKA_BOOTSTRAP)" if bootstrap else "tansu (embedded)"
    kafka = None
    if not bootstrap and broker == "kafka":
        from gpuaas.devstack.kafka import ApacheKafka

        kafka = ApacheKafka(data_dir=root / "kafka", port=free_port(), log_path=root / "kafka.log")
        await asyncio.to_thread(kafka.start)  # it probes the broker with its own event loop
        bootstrap, broker_name = kafka.bootstrap, "apache kafka (started here; outage check)"
    if not bootstrap:
        tansu = Tansu(port=free_port(), log_path=root / "tansu.log")
        tansu.start()
        bootstrap = tansu.bootstrap
    bench = Bench(db, bootstrap, n, kafka)
    try:
        await bench.setup()
        rates: dict[str, list[float]] = {"kit": [], "faststream": []}
        for r in range(rounds):
            topic = await bench.topic()
            order = ("kit", "faststream") if r % 2 == 0 else ("faststream", "kit")
            for impl in order:
                rates[impl].append(await bench.throughput(impl, topic))
                print(f"round {r + 1}: {impl:10} {rates[impl][-1]:8.0f} events/s", flush=True)
        paired: dict[str, list[float]] = {"kit": [], "faststream": []}
        for r in range(rounds):
            pair = await bench.throughput_paired(await bench.topic())
            for impl, rate in pair.items():
                paired[impl].append(rate)
            print(f"paired {r + 1}: kit {pair['kit']:8.0f}  faststream {pair['faststream']:8.0f} events/s", flush=True)
        checks = {impl: await bench.guarantees(impl) for impl in ("kit", "faststream")}
    finally:
        bench.cleanup()
        if tansu:
            tansu.stop()
        if kafka:
            kafka.stop()
        if pg:
            pg.stop()
    kit, fs = statistics.median(rates["kit"]), statistics.median(rates["faststream"])
    result = {
        "events": n,
        "rounds": rounds,
        "broker": broker_name,
        "events_per_s": rates,
        "median_kit": kit,
        "median_faststream": fs,
        "ratio_faststream_to_kit": fs / kit,
        "paired_events_per_s": paired,
        "paired_ratios": [f / k for f, k in zip(paired["faststream"], paired["kit"], strict=True)],
        "guarantees": checks,
    }
    print(f"\n{n} events x {rounds} rounds, broker: {broker_name}")
    print(f"median events/s: kit {kit:.0f}, faststream {fs:.0f} (faststream/kit {fs / kit:.2f})")
    ratios = result["paired_ratios"]
    print(
        f"paired (both at once) faststream/kit per round: {', '.join(f'{x:.2f}' for x in ratios)}; "
        f"median {statistics.median(ratios):.2f}"
    )
    for impl, c in checks.items():
        print(f"{impl:10} {json.dumps(c)}")
    RESULTS.mkdir(exist_ok=True)
    name = "faststream_consumer" + ("_kafka" if os.environ.get("GPUAAS_KAFKA_BOOTSTRAP") or kafka else "") + ".json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--impl", choices=["kit", "faststream"], required=True)
    w.add_argument("--consumer", required=True)
    w.add_argument("--group", required=True)
    w.add_argument("--db", required=True)
    w.add_argument("--bootstrap", required=True)
    w.add_argument("--fail-first", action="store_true")
    w.add_argument("--prefix", required=True)
    w.add_argument("topics", nargs="+")
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--broker",
        choices=["tansu", "kafka"],
        default="tansu",
        help="without GPUAAS_KAFKA_BOOTSTRAP: the broker to start (kafka adds the broker-outage check)",
    )
    args = parser.parse_args()
    if args.cmd == "worker":
        asyncio.run(worker(args))
    else:
        asyncio.run(main(args.events, args.rounds, args.broker))
