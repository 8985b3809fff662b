"""The downstream billing export (examples/billing-export, on gpuaas.contracts.faststream) against the real stack.

Golden path through the platform: a tenant and project (identity), the GPU price (billing), GPU usage
records of last month on the usage topic (as metering publishes them) rated by billing into charges,
then the tenant's statement for that month closed through the API. The export consumer runs as its own
process, with its own schema in Postgres and its own consumer group, on the same broker (Tansu for
`make test`, Apache Kafka for `make test-kafka`):

- it is SIGKILLed mid-backlog (small batches) and restarted: each charge counted once;
- the export closes on `statement.closed`, and its total and lines equal the statement's, to the cent;
- the whole billing topic is published again (same event ids) and the tenant's charges re-published under
  new event ids: the export does not change;
- a second export, fresh schema and group, reads the whole topic from the beginning: the same totals.
"""

from __future__ import annotations

import asyncio
import csv
import io
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from gpuaas.contracts import parse_event
from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events import billing as bi
from gpuaas.contracts.events import usage as us
from gpuaas.contracts.registry import BILLING, USAGE
from gpuaas.devstack.infra import free_port
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually

pytestmark = pytest.mark.e2e
GPU_PRICE = Decimal("2.50")  # per GPU-hour, H100-80GB gpu_slice (the same price as test_billing_proofs)
N = 1200  # usage records, so charges: the export reads them in batches of 50
PREFIX = os.environ.get("GPUAAS_KAFKA_TOPIC_PREFIX", "")


def last_month() -> datetime:
    this = datetime.now(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return (this - timedelta(days=1)).replace(day=1)


class Export:
    """One billing-export process (`python -m billing_export serve`) with its own schema and group."""

    def __init__(self, stack: Stack, name: str) -> None:
        self.stack = stack
        self.schema = f"bx_{name}"
        self.group = f"billing-export-{name}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(stack.logs_dir) / f"billing-export-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {
            **os.environ,
            "BILLING_EXPORT_DATABASE_URL": self.stack.database_admin_url,
            "BILLING_EXPORT_KAFKA_BOOTSTRAP": self.stack.kafka_bootstrap,
            "BILLING_EXPORT_SCHEMA": self.schema,
            "BILLING_EXPORT_GROUP": self.group,
            "BILLING_EXPORT_MAX_RECORDS": "50",
        }
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "billing_export", "serve", "--port", str(self.port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    async def ready(self) -> None:
        async def healthy() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"billing-export exited: {self.log}"
            try:
                async with httpx.AsyncClient(timeout=2) as c:
                    return (await c.get(f"{self.url}/healthz")).status_code == 200
            except httpx.TransportError:
                return False

        await eventually(healthy, 60, f"billing-export up (log: {self.log})")

    def stop(self, sig: int = signal.SIGTERM) -> float:
        """Signal the process and wait for it; the seconds it took."""
        t = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        return time.monotonic() - t

    async def sql(self, query: str, *args: Any) -> Any:
        conn = await asyncpg.connect(self.stack.database_admin_url)
        try:
            return await conn.fetchval(query.format(s=self.schema), *args)
        finally:
            await conn.close()

    async def charges(self, tenant: str) -> int:
        return await self.sql("SELECT count(*) FROM {s}.charges WHERE tenant_id = $1", uuid.UUID(tenant))

    async def export(self, tenant: str) -> dict[str, Any] | None:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as c:
            rows = (await c.get("/exports", params={"tenant_id": tenant})).json()
        return rows[0] if rows else None

    async def csv_lines(self, tenant: str, period: str) -> list[dict[str, str]]:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as c:
            r = await c.get(f"/exports/{tenant}/{period}/USD.csv")
        assert r.status_code == 200, r.text
        return list(csv.DictReader(io.StringIO(r.text)))


@pytest.fixture(scope="module")
def exports(stack: Stack) -> Iterator[list[Export]]:
    started: list[Export] = []
    yield started
    for e in started:
        e.stop(signal.SIGKILL)


async def publish(stack: Stack, topic: str, values: list[tuple[bytes | None, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka_bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        futures = [await producer.send(PREFIX + topic, value, key=key) for key, value in values]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def drained(stack: Stack, export: Export, like: bi.ChargePosted) -> None:
    """Probes behind everything on the billing topic so far: one charge of another (new) tenant on each
    partition. The export consumes each partition in order, so once its inbox holds every probe it has
    consumed every record before them: a replayed record still in flight would show by now."""
    probe_tenant = uuid.uuid4()
    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        partitions = sorted(await producer.partitions_for(PREFIX + BILLING))
        probes = [
            bi.ChargePosted.build(
                data=like.data.model_copy(
                    update={"charge_id": uuid.uuid4(), "usage_record_id": uuid.uuid4(), "tenant_id": probe_tenant}
                ),
                source="billing",
            )
            for _ in partitions
        ]
        futures = [
            await producer.send(PREFIX + BILLING, stack.credentials.signed_payload(e), key=e.key(), partition=p)
            for e, p in zip(probes, partitions, strict=True)
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    ids = [e.id for e in probes]
    await eventually(
        lambda: _equals(export.sql("SELECT count(*) FROM {s}.inbox WHERE event_id = ANY($1)", ids), len(ids)),
        120,
        f"the export consuming the probes on all {len(ids)} billing partitions",
    )


async def read_topic(stack: Stack, topic: str) -> list[tuple[bytes | None, bytes]]:
    """Every record of a topic from the beginning, as a fresh consumer reads it."""
    consumer = AIOKafkaConsumer(
        PREFIX + topic,
        bootstrap_servers=stack.kafka_bootstrap,
        group_id=f"replay-{uuid.uuid4()}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    out: list[tuple[bytes | None, bytes]] = []
    try:
        idle = 0
        while idle < 3:
            batch = await consumer.getmany(timeout_ms=1000, max_records=5000)
            idle = 0 if batch else idle + 1
            out += [(m.key, m.value) for msgs in batch.values() for m in msgs]
    finally:
        await consumer.stop()
    return out


async def tenancy(gw: httpx.AsyncClient) -> tuple[str, str]:
    run = uuid.uuid4().hex[:8]
    r = await gw.post("/api/identity/tenants", json={"slug": f"export-{run}", "name": "Billing export"})
    assert r.status_code == 201, r.text
    tenant = r.json()["tenant_id"]
    r = await gw.post(f"/api/identity/tenants/{tenant}/projects", json={"name": "export"})
    assert r.status_code == 201, r.text
    project = r.json()["project_id"]
    price = {
        "unit": "gpu_hour",
        "unit_price": str(GPU_PRICE),
        "currency": "USD",
        "gpu_model": "H100-80GB",
        "shape": "gpu_slice",
        "effective_from": (last_month() - timedelta(days=45)).isoformat(),
    }
    r = await gw.post("/api/billing/prices", json=price)
    assert r.status_code in (201, 409), r.text  # 409: published by another module of this session

    async def projected() -> bool:
        return (await gw.get("/api/billing/costs", params={"project_id": project})).status_code == 200

    await eventually(projected, 60, "the project in billing's IAM projection")
    return tenant, project


def usage_records(tenant: str, project: str) -> list[us.UsageRecorded]:
    base = last_month() + timedelta(days=2)
    out = []
    for i in range(N):
        alloc = uuid.uuid4()
        start = base + timedelta(minutes=i)
        data = us.UsageRecord(
            usage_record_id=us.usage_record_id(alloc, start),
            allocation_id=alloc,
            tenant_id=tenant,
            project_id=project,
            shape=CapacityShape.gpu_slice,
            gpu_model="H100-80GB",
            gpu_count=1 + i % 3,
            window_start=start,
            window_end=start + timedelta(seconds=36 + i % 25),
            gpu_seconds=Decimal((36 + i % 25) * (1 + i % 3)),
        )
        out.append(us.UsageRecorded.build(data=data, source="metering"))
    return out


def same_as_statement(statement: dict[str, Any], export: dict[str, Any], lines: list[dict[str, str]]) -> None:
    assert export["status"] == "closed" and export["statement_id"] == statement["statement_id"], export
    assert Decimal(export["total"]) == Decimal(statement["total_amount"]), (export, statement["total_amount"])
    assert Decimal(export["statement_total"]) == Decimal(statement["total_amount"]) and export["reconciled"]
    assert export["charges"] == N and export["late_charges"] == 0
    got = sorted((x["project_id"], x["sku"], Decimal(x["quantity"]), Decimal(x["amount"])) for x in lines)
    want = sorted((x["project_id"], x["sku"], Decimal(x["quantity"]), Decimal(x["amount"])) for x in statement["lines"])
    assert got == want
    assert sum(Decimal(x["amount"]) for x in lines) == Decimal(statement["total_amount"])


async def test_the_export_equals_the_statement_after_a_kill_and_a_full_replay(stack, gw, exports) -> None:
    tenant, project = await tenancy(gw)
    records = usage_records(tenant, project)
    await publish(stack, USAGE, [(e.key(), stack.credentials.signed_payload(e)) for e in records])

    async def charged() -> bool:
        n = await stack.fetchval("billing", "SELECT count(*) FROM charges WHERE tenant_id = $1", uuid.UUID(tenant))
        return n == N

    await eventually(charged, 180, f"billing charging {N} usage records")

    # The export reads the backlog in batches of 50; SIGKILL it mid-way, then restart it.
    first = Export(stack, uuid.uuid4().hex[:8])
    exports.append(first)
    first.start()
    await first.ready()
    await eventually(lambda: first.charges(tenant), 120, "the export's first batch", interval_s=0.01)
    first.stop(signal.SIGKILL)
    seen = await first.charges(tenant)
    assert 0 < seen < N, f"the kill did not land mid-backlog ({seen}/{N})"
    first.start()
    await first.ready()
    await eventually(lambda: _equals(first.charges(tenant), N), 120, f"the export counting {N} charges")

    period = last_month().strftime("%Y-%m")
    r = await gw.post("/api/billing/statements/close", json={"tenant_id": tenant, "period": period})
    assert r.status_code == 201, r.text
    [statement] = r.json()
    assert Decimal(statement["total_amount"]) > 0

    async def closed() -> dict[str, Any] | None:
        x = await first.export(tenant)
        return x if x and x["status"] == "closed" else None

    await eventually(closed, 120, "the export closed by statement.closed")
    export = await first.export(tenant)
    assert export is not None
    same_as_statement(statement, export, await first.csv_lines(tenant, period))
    billing_total = await stack.fetchval(
        "billing", "SELECT total_amount FROM statements WHERE statement_id = $1", uuid.UUID(statement["statement_id"])
    )
    assert Decimal(export["total"]) == billing_total  # the billing service's own row, to the cent

    # Replay: the whole billing topic again (same event ids), and this tenant's charges under new ids.
    topic = await read_topic(stack, BILLING)
    mine = [
        e
        for _, v in topic
        if isinstance(e := parse_event(BILLING, v), bi.ChargePosted) and str(e.data.tenant_id) == tenant
    ]
    assert len(mine) == N
    fresh = [bi.ChargePosted.build(data=e.data, source="billing") for e in mine]
    inbox_before = await first.sql("SELECT count(*) FROM {s}.inbox")
    await publish(stack, BILLING, [*topic, *((e.key(), stack.credentials.signed_payload(e)) for e in fresh)])
    await eventually(
        lambda: _at_least(first.sql("SELECT count(*) FROM {s}.inbox"), inbox_before + N),
        180,
        "the export consuming the replay",
    )
    await drained(stack, first, mine[0])  # every replayed record is consumed by now
    assert await first.export(tenant) == export
    same_as_statement(statement, export, await first.csv_lines(tenant, period))

    # A second export from scratch (own schema, own group) reads the whole topic: the same result.
    second = Export(stack, uuid.uuid4().hex[:8])
    exports.append(second)
    second.start()
    await second.ready()
    await eventually(closed_with(second, tenant, export["total"]), 180, "a fresh export of the whole topic")
    again = await second.export(tenant)
    assert again is not None
    same_as_statement(statement, again, await second.csv_lines(tenant, period))
    second.stop()
    took = first.stop()
    # SIGTERM: a bounded, clean shutdown (uvicorn re-raises the signal after it, hence -SIGTERM)
    assert first.proc is not None and first.proc.returncode in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in first.log.read_text(errors="replace") and took < 15
    print(
        f"\nbilling-export e2e: {N} charges, killed after {seen}, statement {statement['total_amount']} == export "
        f"{export['total']} (after the kill, the replay of {len(topic)} + {len(fresh)} records, and a fresh "
        f"export); shutdown {took:.1f}s"
    )


def closed_with(export: Export, tenant: str, total: str) -> Any:
    async def check() -> bool:
        x = await export.export(tenant)
        return bool(x and x["status"] == "closed" and x["total"] == total and x["charges"] == N)

    return check


async def _equals(value: Any, expected: Any) -> bool:
    return (await value) == expected


async def _at_least(value: Any, expected: Any) -> bool:
    return (await value) >= expected
