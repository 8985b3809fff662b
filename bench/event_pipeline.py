"""Event pipeline benchmark: outbox in one service → broker → inbox in another, against the raw broker.

Runs identity and allocations as real processes (the same Stack as `make run`, on free ports, with
its own embedded Postgres and broker unless GPUAAS_DATABASE_URL / GPUAAS_KAFKA_BOOTSTRAP are set):

1. pipeline: commit N audit events through allocations' transactional outbox (batches of 500 per
   transaction, as use cases would), the allocations relay publishes them (acks=all), identity's
   consumer applies them (inbox row + audit row per event, one DB transaction per batch).
   events/s = N / (last applied - first committed); latency = applied row's clock_timestamp() - event time.
2. baseline: aiokafka produce (acks=all) + consume of the same payloads on the same broker, in this
   process; latency = consume time - produce time.

Prints both and the ratio; writes bench/results/event_pipeline.json.

    uv run python bench/event_pipeline.py [--events 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from gpuaas.contracts import Actor
from gpuaas.contracts.events.audit import AuditRecord, AuditRecorded
from gpuaas.devstack.stack import Stack, StackConfig
from gpuaas.kit.db import create_engine, session_factory
from gpuaas.kit.outbox import add_events

RESULTS = Path(__file__).parent / "results"


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def make_events(run: str, n: int) -> list[AuditRecorded]:
    return [
        AuditRecorded.build(
            subject=f"{run}-{i % 64}",
            source="allocations",
            actor=Actor.system("bench"),
            data=AuditRecord(
                service=run,
                action="bench.write",
                resource_type="probe",
                resource_id=str(i),
                after={"i": i, "pad": "x" * 200},
            ),
        )
        for i in range(n)
    ]


async def pipeline(stack: Stack, n: int) -> dict[str, float]:
    run = "bench-" + uuid.uuid4().hex[:8]
    engine = create_engine(stack.database_url("allocations"), "allocations", pool_size=2)
    sessions = session_factory(engine)
    events = make_events(run, n)
    started = time.time()
    for start in range(0, n, 500):
        chunk = events[start : start + 500]
        for e in chunk:  # event time = commit time of its transaction (within a few ms)
            e.time = datetime.now(UTC)
        async with sessions() as s, s.begin():
            await add_events(s, chunk)
    committed = time.time()
    await engine.dispose()
    while True:
        done = await stack.fetchval("identity", "SELECT count(*) FROM audit_records WHERE service = $1", run)
        if done >= n:
            break
        if time.time() - started > 600:
            raise TimeoutError(f"only {done}/{n} applied")
        await asyncio.sleep(0.2)
    rows = await stack.fetch(
        "identity",
        "SELECT EXTRACT(EPOCH FROM stored_at - occurred_at) AS lat, "
        "EXTRACT(EPOCH FROM stored_at) AS at FROM audit_records WHERE service = $1",
        run,
    )
    lat = [float(r["lat"]) * 1000 for r in rows]
    last = max(float(r["at"]) for r in rows)
    return {
        "events": n,
        "commit_s": committed - started,
        "events_per_s": n / (last - started),
        "p50_ms": statistics.median(lat),
        "p99_ms": pct(lat, 99),
        "max_ms": max(lat),
    }


async def steady_pipeline(stack: Stack, rate: int, seconds: int) -> dict[str, float]:
    """One event per transaction at a fixed rate: commit→applied latency without a backlog."""
    run = "steady-" + uuid.uuid4().hex[:8]
    engine = create_engine(stack.database_url("allocations"), "allocations", pool_size=2)
    sessions = session_factory(engine)
    n = rate * seconds
    events = make_events(run, n)
    t0 = time.time()
    for i, e in enumerate(events):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.time()))
        e.time = datetime.now(UTC)  # stamped at its own commit, not when the list was built
        async with sessions() as s, s.begin():
            await add_events(s, [e])
    await engine.dispose()
    while await stack.fetchval("identity", "SELECT count(*) FROM audit_records WHERE service = $1", run) < n:
        await asyncio.sleep(0.2)
    rows = await stack.fetch(
        "identity",
        "SELECT EXTRACT(EPOCH FROM stored_at - occurred_at) AS lat FROM audit_records WHERE service = $1",
        run,
    )
    lat = [float(r["lat"]) * 1000 for r in rows]
    return {"events": n, "rate_per_s": rate, "p50_ms": statistics.median(lat), "p99_ms": pct(lat, 99)}


async def steady_baseline(bootstrap: str, rate: int, seconds: int) -> dict[str, float]:
    """The same single-message cadence on the raw broker: produce (acks=all) → consume."""
    topic = "bench.steady." + uuid.uuid4().hex[:8]
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(topic, 4, 1)])
    await admin.close()
    n = rate * seconds
    payloads = [e.model_dump_json().encode() for e in make_events("steady-baseline", n)]
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=topic,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
        fetch_max_wait_ms=200,
    )
    await consumer.start()
    while not consumer.assignment():
        await asyncio.sleep(0.05)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    sent_at: dict[int, float] = {}
    lat: list[float] = []

    async def consume() -> None:
        while len(lat) < n:
            batch = await consumer.getmany(timeout_ms=500)
            now = time.time()
            lat.extend((now - sent_at[int(m.key)]) * 1000 for msgs in batch.values() for m in msgs)

    reader = asyncio.create_task(consume())
    t0 = time.time()
    for i in range(n):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.time()))
        sent_at[i] = time.time()
        await producer.send_and_wait(topic, payloads[i], key=str(i).encode())
    await reader
    await producer.stop()
    await consumer.stop()
    return {"events": n, "rate_per_s": rate, "p50_ms": statistics.median(lat), "p99_ms": pct(lat, 99)}


async def baseline(bootstrap: str, n: int) -> dict[str, float]:
    topic = "bench.baseline." + uuid.uuid4().hex[:8]
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(topic, 4, 1)])
    await admin.close()
    payloads = [e.model_dump_json().encode() for e in make_events("baseline", n)]
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=topic,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
    )
    await consumer.start()
    while not consumer.assignment():
        await asyncio.sleep(0.05)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=2)
    await producer.start()
    sent_at: dict[int, float] = {}
    lat: list[float] = []

    async def consume() -> float:
        while len(lat) < n:
            batch = await consumer.getmany(timeout_ms=500, max_records=500)
            now = time.time()
            for msgs in batch.values():
                for m in msgs:
                    lat.append((now - sent_at[int(m.key)]) * 1000)
            if batch:
                await consumer.commit()
        return time.time()

    reader = asyncio.create_task(consume())
    started = time.time()
    for start in range(0, n, 500):  # the same batching as the relay: send a batch, await its acks
        futures = []
        for i in range(start, min(start + 500, n)):
            sent_at[i] = time.time()
            futures.append(await producer.send(topic, payloads[i], key=str(i).encode()))
        await asyncio.gather(*futures)
    finished = await reader
    await producer.stop()
    await consumer.stop()
    return {
        "events": n,
        "events_per_s": n / (finished - started),
        "p50_ms": statistics.median(lat),
        "p99_ms": pct(lat, 99),
        "max_ms": max(lat),
    }


async def main(n: int, rate: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="gpuaas-bench-"))
    root.chmod(0o755)
    stack = Stack(StackConfig.from_env(root=root, free_ports=True, services=["identity", "allocations"], gateway=False))
    await asyncio.to_thread(stack.start)
    try:
        await pipeline(stack, 500)  # warm-up: connections, prepared statements, group assignment
        pipe = await pipeline(stack, n)
        base = await baseline(stack.kafka_bootstrap, n)
        steady = await steady_pipeline(stack, rate, 15)
        steady_base = await steady_baseline(stack.kafka_bootstrap, rate, 15)
    finally:
        await asyncio.to_thread(stack.stop)
    result = {
        "pipeline": pipe,
        "baseline": base,
        "steady_pipeline": steady,
        "steady_baseline": steady_base,
        "ratio_throughput": pipe["events_per_s"] / base["events_per_s"],
        "ratio_p50": pipe["p50_ms"] / base["p50_ms"],
        "ratio_p99": pipe["p99_ms"] / base["p99_ms"],
        "broker": "external" if stack.external_broker else "tansu (embedded)",
    }
    print(f"event pipeline, {n} events, broker: {result['broker']}")
    print(f"{'':22}{'events/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for name, r in (("outbox→inbox", pipe), ("raw aiokafka", base)):
        print(f"{name:22}{r['events_per_s']:>10.0f}{r['p50_ms']:>10.1f}{r['p99_ms']:>10.1f}{r['max_ms']:>10.1f}")
    print(
        f"ratio pipeline/raw: throughput {result['ratio_throughput']:.2f}x, p50 {result['ratio_p50']:.1f}x, "
        f"p99 {result['ratio_p99']:.1f}x   (burst: latency includes the backlog)"
    )
    print(f"steady {rate}/s for 15 s, one event per transaction, commit→applied latency:")
    for name, r in (("outbox→inbox", steady), ("raw aiokafka", steady_base)):
        print(f"{name:22}{'':>10}{r['p50_ms']:>10.1f}{r['p99_ms']:>10.1f}")
    print(
        f"ratio pipeline/raw: p50 {steady['p50_ms'] / steady_base['p50_ms']:.1f}x, "
        f"p99 {steady['p99_ms'] / steady_base['p99_ms']:.1f}x"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "event_pipeline.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--rate", type=int, default=100, help="events/s of the steady-latency phase")
    args = parser.parse_args()
    asyncio.run(main(args.events, args.rate))
