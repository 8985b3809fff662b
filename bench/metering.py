"""Metering → billing benchmark: usage events on `gpuaas.usage.v1` into rated, balanced ledger entries.

Runs billing (and identity) as real processes (the Stack behind `make run`, free ports, its own embedded
Postgres and broker unless GPUAAS_DATABASE_URL / GPUAAS_KAFKA_BOOTSTRAP are set):

1. pipeline: publish N `usage.recorded` events (as metering's relay does: batches of 500, acks=all, keyed
   by allocation) while billing consumes them live: per event one inbox row, a price lookup, a ledger
   transaction with two entries (deferred balance trigger), a charge, the spend rollup, budget check and a
   `charge.posted` outbox row, one DB transaction per consumed batch.
   events/s = N / (last charge visible - first publish); latency = charge visible (committed; this
   process polls the ledger every 20 ms) - publish time of its event.
2. raw: a plain aiokafka consumer reading the same topic from the beginning in this process (no database):
   messages/s. The ratio pipeline/raw says what rating + the ledger cost against the broker's own speed.

Prints both and the ratio; writes bench/results/metering.json.

    uv run python bench/metering.py [--events 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events import usage as us
from gpuaas.contracts.registry import USAGE
from gpuaas.devstack.stack import Stack, StackConfig
from gpuaas.kit.event_signing import EventSigner

RESULTS = Path(__file__).parent / "results"


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def records(tenant: uuid.UUID, project: uuid.UUID, n: int) -> list[us.UsageRecorded]:
    base = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    out = []
    for _ in range(n):
        alloc = uuid.uuid4()
        data = us.UsageRecord(
            usage_record_id=us.usage_record_id(alloc, base),
            allocation_id=alloc,
            tenant_id=tenant,
            project_id=project,
            shape=CapacityShape.gpu_slice,
            gpu_model="H100-80GB",
            gpu_count=8,
            window_start=base,
            window_end=base + timedelta(hours=1),
            gpu_seconds=Decimal(8 * 3600),
        )
        out.append(us.UsageRecorded.build(data=data, source="metering"))
    return out


async def pipeline(stack: Stack, n: int) -> dict[str, float]:
    tenant, project = uuid.uuid4(), uuid.uuid4()
    events = records(tenant, project, n)
    sent: dict[str, float] = {}
    seen: dict[str, float] = {}
    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka_bootstrap, acks="all", linger_ms=2)
    signer = EventSigner(stack.credentials.event_signing_key("metering"))  # billing takes usage only signed
    await producer.start()
    conn = await stack._connect("billing")
    done = asyncio.Event()

    async def poll() -> None:
        cursor = datetime(1970, 1, 1, tzinfo=UTC)
        while len(seen) < n:
            rows = await conn.fetch(
                "SELECT usage_record_id::text AS u, posted_at FROM charges WHERE tenant_id = $1 AND posted_at > $2",
                tenant,
                cursor - timedelta(seconds=5),
            )
            t = time.time()
            for r in rows:
                seen.setdefault(r["u"], t)
            if rows:
                cursor = max(cursor, max(r["posted_at"] for r in rows))
            await asyncio.sleep(0.02)
        done.set()

    watcher = asyncio.create_task(poll())
    started = time.time()
    try:
        for start in range(0, n, 500):
            futures = []
            for e in events[start : start + 500]:
                sent[str(e.data.usage_record_id)] = time.time()
                payload = signer.sign_payload(e.model_dump_json().encode())
                futures.append(await producer.send(USAGE, payload, key=e.key()))
            await asyncio.gather(*futures)
        published = time.time()
        await asyncio.wait_for(done.wait(), 900)
    finally:
        watcher.cancel()
        await producer.stop()
    balance = await conn.fetchrow(
        "SELECT coalesce(sum(amount) FILTER (WHERE side = 'debit'), 0) AS d, "
        "coalesce(sum(amount) FILTER (WHERE side = 'credit'), 0) AS c FROM ledger_entries"
    )
    charged = await conn.fetchval("SELECT count(*) FROM charges WHERE tenant_id = $1", tenant)
    await conn.close()
    lat = [(seen[k] - sent[k]) * 1000 for k in sent]
    last = max(seen.values())
    return {
        "events": n,
        "charged": charged,
        "publish_s": published - started,
        "events_per_s": n / (last - started),
        "p50_ms": statistics.median(lat),
        "p99_ms": pct(lat, 99),
        "max_ms": max(lat),
        "ledger_balanced": balance["d"] == balance["c"],
    }


async def raw_consume(bootstrap: str) -> dict[str, float]:
    consumer = AIOKafkaConsumer(
        USAGE,
        bootstrap_servers=bootstrap,
        group_id=f"bench-raw-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
        max_poll_records=500,
    )
    await consumer.start()
    try:
        while not consumer.assignment():
            await asyncio.sleep(0.05)
        count, first, last, idle = 0, None, 0.0, 0
        while idle < 4:
            batch = await consumer.getmany(timeout_ms=500, max_records=500)
            if not batch:
                idle += 1
                continue
            idle = 0
            first = first or time.time()
            for msgs in batch.values():
                for m in msgs:
                    json.loads(m.value)  # the consumer parses what it reads, as billing does
                    count += 1
            last = time.time()
    finally:
        await consumer.stop()
    return {"messages": count, "events_per_s": count / (last - first) if first and last > first else 0.0}


async def main(n: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="gpuaas-bench-"))
    root.chmod(0o755)
    stack = Stack(StackConfig.from_env(root=root, free_ports=True, services=["identity", "billing"], gateway=False))
    await asyncio.to_thread(stack.start)
    try:
        # Bench set-up straight in billing's schema (the API path is covered by the tests).
        await stack.execute(
            "billing",
            "INSERT INTO prices (price_id, sku, unit, unit_price, currency, gpu_model, "
            "shape, effective_from) VALUES ($1, 'gpu-hour.H100-80GB.gpu_slice', "
            "'gpu_hour', 2.5, 'USD', 'H100-80GB', 'gpu_slice', now() - interval '40 days')",
            uuid.uuid4(),
        )
        await pipeline(stack, 500)  # warm-up: connections, prepared statements, group assignment
        pipe = await pipeline(stack, n)
        raw = await raw_consume(stack.kafka_bootstrap)
    finally:
        await asyncio.to_thread(stack.stop)
    result = {
        "pipeline": pipe,
        "raw_consume": raw,
        "ratio_throughput": pipe["events_per_s"] / raw["events_per_s"],
        "broker": "external" if stack.external_broker else "tansu (embedded)",
    }
    print(f"metering->billing, {n} usage events, broker: {result['broker']}")
    print(
        f"  usage topic -> rated ledger : {pipe['events_per_s']:8.0f} events/s   event->ledger p50 "
        f"{pipe['p50_ms']:.0f} ms, p99 {pipe['p99_ms']:.0f} ms, max {pipe['max_ms']:.0f} ms; "
        f"charged {pipe['charged']}/{n}, ledger balanced: {pipe['ledger_balanced']}"
    )
    print(f"  raw broker consume          : {raw['events_per_s']:8.0f} msgs/s ({raw['messages']} messages)")
    print(f"  ratio ledger/raw            : {result['ratio_throughput']:.3f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "metering.json").write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=10000)
    asyncio.run(main(parser.parse_args().events))
