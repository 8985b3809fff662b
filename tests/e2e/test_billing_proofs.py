"""Metering and billing proofs on the real stack (every service a process, real broker and Postgres).

- a release_failed allocation stops accruing at the release request;
- posting every app usage event twice (through the gateway) charges each once;
- killing the billing consumer (SIGKILL) mid-batch and restarting it charges each record once;
- replaying the whole usage topic (same event ids, and re-published with new ids) changes nothing;
- after each, the ledger balances (debits == credits) and charge count == usage record count.

Allocation and app-runtime events are put on their topics here with the contracts (as those
services publish them), so the proofs do not depend on their implementation status.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from gpuaas.contracts import Event, parse_event, topic_of
from gpuaas.contracts.enums import AllocationStatus, AppUsageUnit, CapacityShape, InstanceStatus
from gpuaas.contracts.events import allocations as al
from gpuaas.contracts.events import app_runtime as ar
from gpuaas.contracts.events import usage as us
from gpuaas.contracts.registry import USAGE
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually

pytestmark = pytest.mark.e2e
GPU_PRICE = Decimal("2.50")  # per GPU-hour, H100-80GB gpu_slice
TOKEN_PRICE = Decimal("0.000002")  # per token, app 'vllm'


def now() -> datetime:
    return datetime.now(UTC)


async def publish(stack: Stack, events: Sequence[Event]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka_bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        futures = [
            await producer.send(topic_of(e).name, stack.credentials.signed_payload(e), key=e.key()) for e in events
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


@pytest.fixture(scope="module")
async def tenancy(stack: Stack, admin_token: str) -> dict[str, str]:
    """A tenant and project (through identity), prices (through billing), known to metering and billing."""
    h = {"Authorization": f"Bearer {admin_token}"}
    run = uuid.uuid4().hex[:8]
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=h, timeout=30) as gw:
        r = await gw.post("/api/identity/tenants", json={"slug": f"bill-{run}", "name": "Billing proofs"})
        assert r.status_code == 201, r.text
        tenant = r.json()["tenant_id"]
        r = await gw.post(f"/api/identity/tenants/{tenant}/projects", json={"name": "proofs"})
        assert r.status_code == 201, r.text
        project = r.json()["project_id"]
        since = (now() - timedelta(days=45)).isoformat()
        for body in (
            {
                "unit": "gpu_hour",
                "unit_price": str(GPU_PRICE),
                "currency": "USD",
                "gpu_model": "H100-80GB",
                "shape": "gpu_slice",
                "effective_from": since,
            },
            {
                "unit": "tokens",
                "unit_price": str(TOKEN_PRICE),
                "currency": "USD",
                "app_slug": "vllm",
                "effective_from": since,
            },
        ):
            r = await gw.post("/api/billing/prices", json=body)
            assert r.status_code in (201, 409), r.text  # 409: published by an earlier module run

        async def projected() -> bool:  # billing and metering have applied identity's project event
            c = await gw.get("/api/billing/costs", params={"project_id": project})
            m = await gw.get("/api/metering/meters", params={"project_id": project})
            return c.status_code == 200 and m.status_code == 200

        await eventually(projected, 60, "the project in billing's and metering's IAM projections")
    return {"tenant": tenant, "project": project}


async def usage_drained(stack: Stack, tenancy: dict[str, str]) -> None:
    """Probes behind everything put on the usage topic so far: one usage record on each partition, of a GPU
    model that has no price (billing records it and charges nothing). Billing consumes each partition in
    order, so once it has received every probe it has consumed every record before them: a duplicate or a
    late record still in flight would show by now. Metering's outbox is drained first, so that whatever it
    has committed is on the topic before the probes."""

    async def metering_sent() -> bool:
        return await stack.fetchval("metering", "SELECT count(*) FROM outbox WHERE sent_at IS NULL") == 0

    await eventually(metering_sent, 60, "metering's outbox published")
    model = f"PROBE-{uuid.uuid4().hex[:8]}"
    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        partitions = sorted(await producer.partitions_for(USAGE))
        probes = gpu_records(tenancy, len(partitions), model=model)
        futures = [
            await producer.send(USAGE, stack.credentials.signed_payload(e), key=e.key(), partition=p)
            for e, p in zip(probes, partitions, strict=True)
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    ids = [e.data.usage_record_id for e in probes]

    async def received() -> bool:
        n = await stack.fetchval("billing", "SELECT count(*) FROM usage_received WHERE usage_record_id = ANY($1)", ids)
        return n == len(ids)

    await eventually(received, 120, f"billing receiving the probes on all {len(ids)} usage partitions")


async def ledger(stack: Stack) -> tuple[int, Decimal, Decimal, int]:
    """(transactions, debits, credits, unbalanced transactions), straight from billing's schema."""
    row = (
        await stack.fetch(
            "billing",
            """
        SELECT (SELECT count(*) FROM ledger_transactions) AS n,
               coalesce(sum(amount) FILTER (WHERE side = 'debit'), 0) AS d,
               coalesce(sum(amount) FILTER (WHERE side = 'credit'), 0) AS c,
               (SELECT count(*) FROM (SELECT transaction_id FROM ledger_entries GROUP BY transaction_id
                 HAVING sum(amount) FILTER (WHERE side = 'debit') <> sum(amount) FILTER (WHERE side = 'credit')) x)
                 AS bad
          FROM ledger_entries""",
        )
    )[0]
    return row["n"], row["d"], row["c"], row["bad"]


async def assert_balanced(stack: Stack, gw: httpx.AsyncClient) -> None:
    n, d, c, bad = await ledger(stack)
    assert d == c and bad == 0, (n, d, c, bad)
    # every transaction charges a distinct usage record that billing received
    assert await stack.fetchval("billing", "SELECT count(DISTINCT usage_record_id) FROM ledger_transactions") == n
    r = await gw.get("/api/billing/ledger/balance")
    assert r.status_code == 200 and r.json()["balanced"] is True
    assert await stack.fetchval("billing", "SELECT count(*) FROM dead_letters WHERE status = 'parked'") == 0


async def test_release_failed_allocation_stops_accruing_at_the_release_request(stack, gw, tenancy) -> None:
    # Whole windows (1/2 h and 1 h), so each charge's quantity is exact: [H-1.5h, H-1h) and [H-1h, H).
    hour = now().replace(minute=0, second=0, microsecond=0)
    activated = hour - timedelta(hours=1, minutes=30)
    stop = hour
    a = al.AllocationState(
        allocation_id=uuid.uuid4(),
        tenant_id=tenancy["tenant"],
        project_id=tenancy["project"],
        shape=CapacityShape.gpu_slice,
        gpu_model="H100-80GB",
        gpu_count=2,
        host_id=uuid.uuid4(),
        status=AllocationStatus.active,
        status_changed_at=activated,
        requested_at=activated,
        activated_at=activated,
        version=3,
    )
    releasing = a.model_copy(
        update={
            "status": AllocationStatus.releasing,
            "status_changed_at": stop,
            "release_requested_at": stop,
            "billing_stopped_at": stop,
            "version": 4,
        }
    )
    failed = releasing.model_copy(
        update={
            "status": AllocationStatus.release_failed,
            "version": 5,
            "status_changed_at": stop + timedelta(minutes=2),
            "failure_reason": "agent did not confirm teardown",
        }
    )
    await publish(
        stack,
        [
            al.AllocationActivated.build(data=a, source="allocations"),
            al.AllocationReleaseRequested.build(data=releasing, source="allocations"),
            al.AllocationReleaseFailed.build(data=failed, source="allocations"),
        ],
    )
    expected_hours = Decimal(3)  # 2 GPUs x 1.5 h

    async def meter_closed() -> dict | None:
        r = await gw.get(f"/api/metering/meters/{a.allocation_id}")
        return r.json() if r.status_code == 200 and r.json()["status"] == "closed" else None

    await eventually(meter_closed, 60, f"metering closing the meter (stack logs: {stack.logs_dir})")

    async def charged() -> Decimal | None:
        r = await gw.get(
            "/api/billing/charges", params={"project_id": tenancy["project"], "allocation_id": str(a.allocation_id)}
        )
        total = sum((Decimal(c["quantity"]) for c in r.json()), Decimal(0))
        return total if total == expected_hours else None

    await eventually(charged, 60, "the allocation's usage charged up to the release request")
    r = await gw.get(f"/api/metering/meters/{a.allocation_id}")
    assert r.status_code == 200 and r.json()["status"] == "closed"
    assert datetime.fromisoformat(r.json()["closed_at"]) == stop
    assert "release then failed" in r.json()["close_reason"]
    # Nothing more may accrue: a probe meter opened now, with a whole hour already due, is recorded by a pass
    # of the window closer that ran after this meter closed (a pass that would have recorded it too).
    probe = a.model_copy(
        update={
            "allocation_id": uuid.uuid4(),
            "gpu_model": f"PROBE-{uuid.uuid4().hex[:8]}",  # no price: billing charges nothing for it
            "status_changed_at": hour - timedelta(hours=2),
            "requested_at": hour - timedelta(hours=2),
            "activated_at": hour - timedelta(hours=2),
        }
    )
    await publish(stack, [al.AllocationActivated.build(data=probe, source="allocations")])
    await eventually(
        lambda: stack.fetchval(
            "metering", "SELECT count(*) FROM usage_records WHERE allocation_id = $1", probe.allocation_id
        ),
        60,
        "the window closer recording the probe meter's due hour",
    )
    recorded = await stack.fetch(
        "metering",
        "SELECT count(*) AS n, sum(gpu_seconds) AS s FROM usage_records WHERE allocation_id = $1",
        a.allocation_id,
    )
    assert (recorded[0]["n"], recorded[0]["s"]) == (2, expected_hours * 3600), "usage after the release request"
    await usage_drained(stack, tenancy)
    r = await gw.get(
        "/api/billing/charges", params={"project_id": tenancy["project"], "allocation_id": str(a.allocation_id)}
    )
    assert sum(Decimal(c["quantity"]) for c in r.json()) == expected_hours
    assert sum(Decimal(c["amount"]) for c in r.json()) == expected_hours * GPU_PRICE
    await assert_balanced(stack, gw)


async def test_every_app_usage_event_posted_twice_is_charged_once(stack, gw, tenancy) -> None:
    inst = ar.InstanceState(
        instance_id=uuid.uuid4(),
        tenant_id=tenancy["tenant"],
        project_id=tenancy["project"],
        app_slug="vllm",
        app_version="0.6.0",
        manifest_id=uuid.uuid4(),
        artifact_digest="sha256:" + "b" * 64,
        status=InstanceStatus.running,
        status_changed_at=now() - timedelta(hours=1),
        version=1,
    )
    await publish(stack, [ar.InstanceCreated.build(data=inst, source="app-runtime")])
    n = 60
    bodies = [
        {
            "instance_id": str(inst.instance_id),
            "unit": "tokens",
            "quantity": str(1000 + i),
            "idempotency_key": f"req-{i}",
            "occurred_at": (now() - timedelta(seconds=i)).isoformat(),
        }
        for i in range(n)
    ]

    async def first_accepted() -> bool:
        r = await gw.post("/api/metering/usage/app", json=bodies[0])
        return r.status_code in (200, 201)

    # Before the first post: its charge can land before the loop below starts (Apache Kafka is quick).
    before = await ledger(stack)
    await eventually(first_accepted, 60, "metering knowing the instance")
    statuses = []
    for _round in range(2):
        for i in range(0, n, 20):
            rs = await asyncio.gather(*[gw.post("/api/metering/usage/app", json=b) for b in bodies[i : i + 20]])
            statuses += [r.status_code for r in rs]
        assert all(s in (200, 201) for s in statuses), statuses
    assert statuses.count(201) == n - 1  # the first one was accepted while waiting above
    expected = sum((Decimal(b["quantity"]) * TOKEN_PRICE for b in bodies), Decimal(0))

    async def all_charged() -> bool:
        r = await gw.get(
            "/api/billing/charges",
            params={"project_id": tenancy["project"], "instance_id": str(inst.instance_id), "limit": 1000},
        )
        return len(r.json()) == n

    await eventually(all_charged, 60, f"{n} app usage charges")
    await usage_drained(stack, tenancy)  # the second posts' records, had metering emitted them, are charged by now
    r = await gw.get(
        "/api/billing/charges",
        params={"project_id": tenancy["project"], "instance_id": str(inst.instance_id), "limit": 1000},
    )
    assert len(r.json()) == n and sum(Decimal(c["amount"]) for c in r.json()) == expected
    after = await ledger(stack)
    assert after[0] - before[0] == n and after[1] - before[1] == expected
    await assert_balanced(stack, gw)


def gpu_records(tenancy: dict[str, str], n: int, model: str = "H100-80GB") -> list[us.UsageRecorded]:
    base = now() - timedelta(hours=1)
    out = []
    for _ in range(n):
        alloc = uuid.uuid4()
        data = us.UsageRecord(
            usage_record_id=us.usage_record_id(alloc, base),
            allocation_id=alloc,
            tenant_id=tenancy["tenant"],
            project_id=tenancy["project"],
            shape=CapacityShape.gpu_slice,
            gpu_model=model,
            gpu_count=1,
            window_start=base,
            window_end=base + timedelta(seconds=36),
            gpu_seconds=Decimal(36),
        )
        out.append(us.UsageRecorded.build(data=data, source="metering"))
    return out


async def test_billing_killed_mid_batch_charges_each_record_once(stack, gw, tenancy) -> None:
    n = 3000
    records = gpu_records(tenancy, n)
    ids = [str(r.data.usage_record_id) for r in records]
    before = await ledger(stack)
    await asyncio.to_thread(stack.kill, "billing", signal.SIGKILL)
    await publish(stack, records)
    await asyncio.to_thread(stack.start_service, "billing", False)

    async def charged() -> int:
        return await stack.fetchval(
            "billing", "SELECT count(*) FROM charges WHERE usage_record_id::text = ANY($1)", ids
        )

    seen = await eventually(charged, 120, "the first charged batch", interval_s=0.01)
    await asyncio.to_thread(stack.kill, "billing", signal.SIGKILL)
    assert 0 < seen < n, f"the kill did not land mid-stream ({seen}/{n})"
    await asyncio.to_thread(stack.start_service, "billing")
    await eventually(lambda: _is(charged(), n), 120, f"{n} records charged")
    await usage_drained(stack, tenancy)  # the redelivered batch is consumed by now
    assert await charged() == n
    after = await ledger(stack)
    assert after[0] - before[0] == n
    assert after[1] - before[1] == Decimal(n) * GPU_PRICE / 100  # 0.01 GPU-hour each
    await assert_balanced(stack, gw)


async def test_replaying_the_whole_usage_topic_leaves_the_ledger_unchanged(stack, gw, tenancy) -> None:
    before = await ledger(stack)
    assert before[0] > 0, "the other proofs put usage on the topic first"
    # Read the whole topic from the beginning, as a fresh consumer would.
    consumer = AIOKafkaConsumer(
        USAGE,
        bootstrap_servers=stack.kafka_bootstrap,
        group_id=f"replay-{uuid.uuid4()}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    events: list[Event] = []
    try:
        idle = 0
        while idle < 3:
            batch = await consumer.getmany(timeout_ms=1000, max_records=5000)
            idle = 0 if batch else idle + 1
            for msgs in batch.values():
                events += [e for m in msgs if (e := parse_event(USAGE, m.value)) is not None]
    finally:
        await consumer.stop()
    usage_events = [e for e in events if isinstance(e, us.UsageRecorded | us.AppUsageRecorded)]
    assert len(usage_events) >= before[0]
    inbox_before = await stack.fetchval("billing", "SELECT count(*) FROM inbox WHERE topic = $1", USAGE)
    # 1) the same messages again (a consumer group reset / broker-side redelivery)
    # 2) the same records under new event ids (metering recomputing its windows, an outbox replay)
    fresh = [type(e).build(data=e.data, source="metering") for e in usage_events]
    await publish(stack, [*events, *fresh])

    async def consumed() -> bool:
        n = await stack.fetchval("billing", "SELECT count(*) FROM inbox WHERE topic = $1", USAGE)
        return n >= inbox_before + len(fresh)

    await eventually(consumed, 180, "billing consuming the replayed topic")
    await usage_drained(stack, tenancy)  # every replayed record is consumed by now
    assert await ledger(stack) == before
    await assert_balanced(stack, gw)


async def _is(value_coro, expected) -> bool:
    return (await value_coro) == expected


_ = AppUsageUnit  # imported for readers: app usage units are tokens | requests | model_seconds
