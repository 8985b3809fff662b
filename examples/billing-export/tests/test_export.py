"""The billing export on FastStream's in-memory broker (TestKafkaBroker: no Kafka) and a real Postgres.

Charges become invoice lines per tenant x period x currency; a statement closes the export and is
reconciled against it; the same events again (a replay), a charge re-published under a new event id, a
failing batch (rolled back, then applied once), unknown and malformed messages, and the topic prefix.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import asyncpg
import httpx
import pytest
from billing_export import store
from billing_export.app import Consumer, Settings, create_app
from faststream.kafka import TestKafkaBroker

from gpuaas.contracts import Event
from gpuaas.contracts.events import billing as b
from gpuaas.contracts.registry import BILLING

pytestmark = pytest.mark.integration
PERIOD = datetime(2026, 10, 1, tzinfo=UTC)


def charge(tenant: uuid.UUID, project: uuid.UUID, amount: str, *, sku: str = "gpu-hour.H100-80GB.gpu_slice",
           currency: str = "USD", period: datetime = PERIOD) -> b.ChargePosted:  # fmt: skip
    start = period + timedelta(days=3)
    data = b.ChargeState(
        charge_id=uuid.uuid4(),
        usage_record_id=uuid.uuid4(),
        usage_kind="gpu",
        tenant_id=tenant,
        project_id=project,
        sku=sku,
        price_id=uuid.uuid4(),
        quantity=Decimal(amount) / Decimal("2.5"),
        unit=b.PriceUnit.gpu_hour,
        unit_price=Decimal("2.5"),
        amount=Decimal(amount),
        currency=currency,
        usage_start=start,
        usage_end=start + timedelta(hours=1),
        posted_at=start + timedelta(hours=1),
        period_start=period,
    )
    return b.ChargePosted.build(data=data, source="billing")


def statement(tenant: uuid.UUID, charges: list[b.ChargePosted], currency: str = "USD") -> b.StatementClosed:
    lines: dict[tuple[uuid.UUID, str], list[Decimal]] = {}
    for c in charges:
        q = lines.setdefault((c.data.project_id, c.data.sku), [Decimal(0), Decimal(0)])
        q[0] += c.data.quantity
        q[1] += c.data.amount
    data = b.StatementState(
        statement_id=uuid.uuid4(),
        tenant_id=tenant,
        period_start=PERIOD,
        period_end=datetime(2026, 11, 1, tzinfo=UTC),
        currency=currency,
        total_amount=sum((c.data.amount for c in charges), Decimal(0)),
        lines=[
            b.StatementLine(project_id=p, sku=s, quantity=q, unit=b.PriceUnit.gpu_hour, amount=a)
            for (p, s), (q, a) in lines.items()
        ],
        closed_at=datetime(2026, 11, 1, 0, 5, tzinfo=UTC),
    )
    return b.StatementClosed.build(data=data, source="billing")


def wire(events: list[Event]) -> list[bytes]:
    return [e.model_dump_json().encode() for e in events]


@pytest.fixture
async def consumer(infra) -> AsyncIterator[Consumer]:
    settings = Settings(database_url=infra.admin_url, bootstrap="unused:9092", schema=f"bx_{uuid.uuid4().hex[:10]}")
    c = Consumer(settings)
    await c.open()
    try:
        yield c
    finally:
        async with c.pool.acquire() as conn:
            await conn.execute(f"DROP SCHEMA {settings.schema} CASCADE")
        await c.close()


async def exports(c: Consumer, tenant: uuid.UUID) -> list[dict]:
    async with c.pool.acquire() as conn:
        return await store.exports(conn, c.settings.schema, tenant)


async def test_charges_become_invoice_lines_and_the_statement_closes_the_export(consumer: Consumer) -> None:
    tenant, p1, p2 = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    charges = [charge(tenant, p1, "2.50"), charge(tenant, p1, "1.25"), charge(tenant, p2, "0.10")]
    eur = charge(tenant, p1, "9.99", currency="EUR")
    async with TestKafkaBroker(consumer.broker) as br:
        await br.publish_batch(*wire([*charges, eur]), topic=BILLING)
        [usd_open] = [x for x in await exports(consumer, tenant) if x["currency"] == "USD"]
        assert usd_open["status"] == "open" and usd_open["total"] == "3.85" and not usd_open["reconciled"]
        await br.publish_batch(*wire([statement(tenant, charges)]), topic=BILLING)
    by_currency = {x["currency"]: x for x in await exports(consumer, tenant)}
    usd = by_currency["USD"]
    assert usd["status"] == "closed" and usd["statement_total"] == "3.85" and usd["total"] == "3.85"
    assert usd["reconciled"] is True and usd["charges"] == 3 and usd["period"] == "2026-10"
    assert by_currency["EUR"]["status"] == "open" and by_currency["EUR"]["total"] == "9.99"

    app = create_app(consumer.settings, consume=False)
    app.state.consumer.pool = consumer.pool  # the HTTP side reads the same schema
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as http:
        r = await http.get(f"/exports/{tenant}/2026-10/usd.csv")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
        rows = [line.split(",") for line in r.text.strip().splitlines()]
        assert rows[0][-1] == "amount" and len(rows) == 3  # header + one line per project
        assert sum(Decimal(row[-1]) for row in rows[1:]) == Decimal("3.85")
        assert (await http.get(f"/exports/{tenant}/2026-09/USD.csv")).status_code == 404
        r = await http.get("/exports", params={"tenant_id": str(tenant)})
        assert {x["currency"] for x in r.json()} == {"USD", "EUR"}


async def test_a_replay_and_a_republished_charge_change_nothing(consumer: Consumer) -> None:
    tenant, project = uuid.uuid4(), uuid.uuid4()
    charges = [charge(tenant, project, f"{i}.01") for i in range(1, 6)]
    events: list[Event] = [*charges, statement(tenant, charges)]
    async with TestKafkaBroker(consumer.broker) as br:
        await br.publish_batch(*wire(events), topic=BILLING)
        before = await exports(consumer, tenant)
        await br.publish_batch(*wire(events), topic=BILLING)  # the whole topic again, same event ids
        republished = b.ChargePosted.build(data=charges[0].data, source="billing")  # new event id, same charge
        await br.publish_batch(*wire([republished]), topic=BILLING)
    after = await exports(consumer, tenant)
    assert after == before and after[0]["total"] == "15.05" and after[0]["reconciled"] is True
    async with consumer.pool.acquire() as conn:
        inbox = await conn.fetchval(f"SELECT count(*) FROM {consumer.settings.schema}.inbox")
    assert inbox == len(events) + 1  # the re-published charge is a new event (recorded), not a new charge


async def test_a_failing_batch_is_rolled_back_whole_and_applied_once_when_retried(
    consumer: Consumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant, project = uuid.uuid4(), uuid.uuid4()
    charges = [charge(tenant, project, "1.00") for _ in range(4)]
    real_apply = store.apply
    calls = 0

    async def fail_after_writing(conn: asyncpg.Connection, schema: str, events: list[Event]) -> None:
        nonlocal calls
        calls += 1
        await real_apply(conn, schema, events)  # writes everything, then the batch fails
        if calls == 1:
            raise RuntimeError("injected failure after the writes")

    monkeypatch.setattr(store, "apply", fail_after_writing)
    async with TestKafkaBroker(consumer.broker) as br:
        with pytest.raises(RuntimeError, match="injected"):
            await br.publish_batch(*wire(charges), topic=BILLING)
        assert await exports(consumer, tenant) == []  # nothing of the batch, not even its inbox rows
        async with consumer.pool.acquire() as conn:
            assert await conn.fetchval(f"SELECT count(*) FROM {consumer.settings.schema}.inbox") == 0
        await br.publish_batch(*wire(charges), topic=BILLING)  # redelivered after the rewind
    [x] = await exports(consumer, tenant)
    assert x["total"] == "4.00" and x["charges"] == 4 and calls == 2


async def test_unknown_types_and_malformed_messages_are_skipped_not_fatal(consumer: Consumer) -> None:
    tenant, project = uuid.uuid4(), uuid.uuid4()
    good = charge(tenant, project, "7.00")
    newer = good.model_dump(mode="json") | {"type": "invoice.disputed", "id": str(uuid.uuid4())}
    bad = good.model_dump(mode="json") | {"id": str(uuid.uuid4()), "data": {"amount": "not money"}}
    async with TestKafkaBroker(consumer.broker) as br:
        await br.publish_batch(
            json.dumps(newer).encode(), b"{not json", json.dumps(bad).encode(), *wire([good]), topic=BILLING
        )
    [x] = await exports(consumer, tenant)
    assert x["total"] == "7.00" and x["charges"] == 1


async def test_the_topic_prefix_applies_to_the_topic_and_the_group(infra) -> None:
    schema = f"bx_{uuid.uuid4().hex[:10]}"
    c = Consumer(Settings(database_url=infra.admin_url, bootstrap="unused:9092", schema=schema, prefix="staging."))
    [sub] = list(c.broker.subscribers)
    assert [t.name for t in sub.topics] == ["staging." + BILLING] and sub.group_id == "staging.billing-export"
    assert sub._connection_args["enable_auto_commit"] is False  # offsets only after the transaction
    doc = c.asyncapi()
    [channel] = doc["channels"].values()
    assert channel["address"] == "staging." + BILLING
    text = json.dumps(doc)
    assert "ChargePosted" in text and "StatementClosed" in text  # the typed union is documented
    await c.open()
    try:
        tenant = uuid.uuid4()
        async with TestKafkaBroker(c.broker) as br:
            await br.publish_batch(*wire([charge(tenant, uuid.uuid4(), "3.30")]), topic="staging." + BILLING)
        [x] = await exports(c, tenant)
        assert x["total"] == "3.30"
    finally:
        async with c.pool.acquire() as conn:
            await conn.execute(f"DROP SCHEMA {schema} CASCADE")
        await c.close()


async def test_a_statement_read_before_its_charges_reconciles_once_they_arrive(consumer: Consumer) -> None:
    # Charges and statements are keyed differently, so on different partitions: a fresh consumer of the
    # whole topic may well read the statement first.
    tenant, project = uuid.uuid4(), uuid.uuid4()
    charges = [charge(tenant, project, "0.33") for _ in range(3)]
    async with TestKafkaBroker(consumer.broker) as br:
        await br.publish_batch(*wire([statement(tenant, charges), charges[0]]), topic=BILLING)
        [x] = await exports(consumer, tenant)
        assert x["status"] == "closed" and x["total"] == "0.33" and x["reconciled"] is False
        await br.publish_batch(*wire(charges[1:]), topic=BILLING)
    [x] = await exports(consumer, tenant)
    assert x["total"] == "0.99" == x["statement_total"] and x["reconciled"] is True
    assert x["late_charges"] == 0  # posted before the statement closed, whatever the reading order
