"""Billing against the real broker and Postgres: rating once, the ledger's guarantees, views, budgets,
statements and access."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from gpuaas.billing.domain import month_start
from gpuaas.kit.testing import wait_for

pytestmark = pytest.mark.integration


def now() -> datetime:
    return datetime.now(UTC)


async def q(kit, sql: str, **params):  # type: ignore[no-untyped-def]
    async with kit.sessions() as s:
        return (await s.execute(text(sql), params)).scalar_one()


async def charged(kit, tenant) -> int:  # type: ignore[no-untyped-def]
    return await q(kit, "SELECT count(*) FROM charges WHERE tenant_id = :t", t=tenant)


async def set_prices(client, auth, w, gpu: str = "2.50", tokens: str = "0.000002", frm=None):  # type: ignore[no-untyped-def]
    op = auth(w["op"])
    extra = {"effective_from": frm.isoformat()} if frm else {}
    r = await client.post(
        "/prices",
        json={
            "unit": "gpu_hour",
            "unit_price": gpu,
            "currency": "USD",
            "gpu_model": "H100-80GB",
            "shape": "gpu_slice",
            **extra,
        },
        headers=op,
    )
    assert r.status_code == 201, r.text
    r = await client.post(
        "/prices",
        json={"unit": "tokens", "unit_price": tokens, "currency": "USD", "app_slug": "vllm", **extra},
        headers=op,
    )
    assert r.status_code == 201, r.text


async def test_usage_is_rated_once_into_a_balanced_ledger(h, billing, infra, auth) -> None:  # type: ignore[no-untyped-def]
    client, kit, w = billing
    await set_prices(client, auth, w, frm=now() - timedelta(days=40))
    start = now() - timedelta(hours=2)
    g = h.gpu_usage(w["t1"], w["p1"], start, start + timedelta(minutes=30), gpus=2)  # 1 GPU-hour
    a = h.app_usage(w["t1"], w["p1b"], now() - timedelta(minutes=5), "1000000", "k1")  # 1M tokens
    # The same records again under new event ids (a metering recompute / a replayed range) and as-is.
    g2 = type(g).build(data=g.data, source="metering")
    a2 = type(a).build(data=a.data, source="metering")
    await h.publish(infra.kafka_bootstrap, [g, a, g2, a2, g, a])
    await wait_for(lambda: _is(charged(kit, w["t1"]), 2), 30, "two charges")
    probe = h.app_usage(w["t1"], w["p1"], now(), "1", "probe")  # ordered after the duplicates on no partition...
    await h.publish(infra.kafka_bootstrap, [probe])
    await wait_for(lambda: _is(charged(kit, w["t1"]), 3), 30, "probe charged")
    assert await q(kit, "SELECT amount FROM charges WHERE usage_record_id = :u", u=g.data.usage_record_id) == Decimal(
        "2.500000"
    )
    assert await q(kit, "SELECT quantity FROM charges WHERE usage_record_id = :u", u=g.data.usage_record_id) == Decimal(
        "1.000000000"
    )
    assert await q(
        kit, "SELECT amount FROM charges WHERE usage_record_id = :u", u=a.data.app_usage_record_id
    ) == Decimal("2.000000")
    # GPU time and app usage are separate SKUs: the app charge carries no GPU time.
    skus = await q(
        kit, "SELECT string_agg(DISTINCT sku, ',' ORDER BY sku) FROM charges WHERE tenant_id = :t", t=w["t1"]
    )
    assert skus == "app.vllm.tokens,gpu-hour.H100-80GB.gpu_slice"
    r = await client.get("/ledger/balance", headers=auth(w["op"]))
    assert r.status_code == 200 and r.json()["balanced"] is True and r.json()["unbalanced_transactions"] == 0
    usd = next(c for c in r.json()["currencies"] if c["currency"] == "USD")
    assert Decimal(usd["debits"]) == Decimal(usd["credits"])
    # Other tests' usage on the shared topic may be rated here too: the exact total is this tenant's.
    assert await q(kit, "SELECT sum(amount) FROM charges WHERE tenant_id = :t", t=w["t1"]) == Decimal("4.500002")
    posted = (
        "SELECT count(*) FROM outbox WHERE event_type = 'charge.posted' AND aggregate_id IN "
        "(SELECT usage_record_id::text FROM charges WHERE tenant_id = :t)"
    )
    assert await q(kit, posted, t=w["t1"]) == 3


async def test_the_database_refuses_double_charges_unbalanced_and_rewritten_entries(billing) -> None:  # type: ignore[no-untyped-def]
    _, kit, w = billing
    txn, usage_id = uuid.uuid4(), uuid.uuid4()

    async def run(*statements: str) -> None:
        async with kit.sessions() as s, s.begin():
            for sql in statements:
                await s.execute(text(sql))

    tx = (
        f"INSERT INTO ledger_transactions (transaction_id, usage_record_id, tenant_id, currency, memo) "
        f"VALUES ('{txn}', '{usage_id}', '{w['t1']}', 'USD', 'test')"
    )

    def entry(side: str, amount: str, t: uuid.UUID = txn) -> str:
        return (
            f"INSERT INTO ledger_entries (entry_id, transaction_id, account, side, amount, currency) "
            f"VALUES ('{uuid.uuid4()}', '{t}', 'a', '{side}', {amount}, 'USD')"
        )

    with pytest.raises(DBAPIError, match="does not balance"):
        await run(tx, entry("debit", "10"), entry("credit", "9.99"))
    with pytest.raises(DBAPIError, match="does not balance"):
        await run(tx, entry("debit", "10"))
    await run(tx, entry("debit", "10"), entry("credit", "10"))
    other = uuid.uuid4()
    with pytest.raises(DBAPIError, match="usage_record_id"):  # a usage record is charged once
        await run(tx.replace(str(txn), str(other)), entry("debit", "1", other), entry("credit", "1", other))
    for sql in (
        "UPDATE ledger_entries SET amount = 0",
        "DELETE FROM ledger_entries",
        "DELETE FROM ledger_transactions",
        "TRUNCATE ledger_entries CASCADE",
    ):
        with pytest.raises(DBAPIError, match="append-only"):
            await run(sql)
    assert await q(kit, "SELECT count(*) FROM ledger_entries WHERE transaction_id = :t", t=txn) == 2


async def test_usage_without_a_price_waits_and_is_rated_when_one_is_published(h, billing, infra, auth) -> None:  # type: ignore[no-untyped-def]
    client, kit, w = billing
    start = now() - timedelta(hours=3)
    g = h.gpu_usage(w["t1"], w["p1"], start, start + timedelta(hours=1), gpus=1, model="A100-40GB")
    await h.publish(infra.kafka_bootstrap, [g])
    await wait_for(
        lambda: _is(
            q(kit, "SELECT count(*) FROM usage_received WHERE usage_record_id = :u", u=g.data.usage_record_id), 1
        ),
        30,
        "received",
    )
    assert await charged(kit, w["t1"]) == 0
    body = {
        "unit": "gpu_hour",
        "unit_price": "1.20",
        "currency": "EUR",
        "gpu_model": "A100-40GB",
        "shape": "gpu_slice",
        "effective_from": (start - timedelta(days=1)).isoformat(),
    }
    r = await client.post("/prices", json=body, headers=auth(w["op"]))
    assert r.status_code == 201 and r.json()["rated_waiting_usage"] == 1
    assert await q(kit, "SELECT amount FROM charges WHERE usage_record_id = :u", u=g.data.usage_record_id) == Decimal(
        "1.200000"
    )
    # A price dated before usage already charged would rewrite history: refused.
    r = await client.post(
        "/prices", json={**body, "effective_from": (start - timedelta(minutes=1)).isoformat()}, headers=auth(w["op"])
    )
    assert r.status_code == 409 and r.json()["code"] == "price_would_rewrite_charges"
    r = await client.post("/prices", json={**body, "unit_price": "-1"}, headers=auth(w["op"]))
    assert r.status_code == 422
    r = await client.post("/prices", json={**body, "app_slug": "vllm"}, headers=auth(w["op"]))
    assert r.status_code == 422 and r.json()["code"] == "price_target"
    r = await client.post("/prices", json={**body, "effective_from": now().isoformat()}, headers=auth(w["tadmin"]))
    assert r.status_code == 403
    assert await q(kit, "SELECT count(*) FROM prices") == 1


async def test_budgets_alert_once_per_threshold_and_costs_split_per_project(h, billing, infra, auth) -> None:  # type: ignore[no-untyped-def]
    client, kit, w = billing
    await set_prices(client, auth, w, frm=now() - timedelta(days=40))
    r = await client.post(
        "/budgets",
        json={"tenant_id": str(w["t1"]), "limit_amount": "10", "currency": "USD", "thresholds": [50, 80, 100]},
        headers=auth(w["tadmin"]),
    )
    assert r.status_code == 201, r.text
    budget_id = r.json()["budget_id"]
    r = await client.post(
        "/budgets", json={"tenant_id": str(w["t1"]), "limit_amount": "10", "currency": "USD"}, headers=auth(w["padmin"])
    )
    assert r.status_code == 403
    r = await client.post(
        "/budgets", json={"tenant_id": str(w["t1"]), "limit_amount": "0", "currency": "USD"}, headers=auth(w["tadmin"])
    )
    assert r.status_code == 422
    base = max(month_start(now()), now() - timedelta(hours=3))
    # 2 GPU-hours = 5 USD in p1 (50 %), then 1.2 GPU-hours = 3 USD in p1b (80 %).
    e1 = h.gpu_usage(w["t1"], w["p1"], base, base + timedelta(minutes=30), gpus=4)
    e2 = h.gpu_usage(w["t1"], w["p1b"], base, base + timedelta(minutes=36), gpus=2)
    await h.publish(infra.kafka_bootstrap, [e1, e2])
    await wait_for(lambda: _is(charged(kit, w["t1"]), 2), 30, "charges")
    alerts = await q(
        kit,
        "SELECT string_agg(threshold_percent::text, ',' ORDER BY threshold_percent) "
        "FROM budget_alerts WHERE budget_id = :b",
        b=budget_id,
    )
    assert alerts == "50,80"
    assert await q(kit, "SELECT count(*) FROM outbox WHERE event_type = 'budget.threshold_crossed'") == 2
    r = await client.get("/costs", params={"tenant_id": str(w["t1"])}, headers=auth(w["tadmin"]))
    assert r.status_code == 200, r.text
    split = {p["project_id"]: Decimal(p["amount"]) for p in r.json()["projects"]}
    assert split == {str(w["p1"]): Decimal("5"), str(w["p1b"]): Decimal("3")}
    assert Decimal(r.json()["totals"][0]["amount"]) == Decimal("8")
    r = await client.get("/costs", params={"project_id": str(w["p1"])}, headers=auth(w["padmin"]))
    assert r.status_code == 200 and [p["project_id"] for p in r.json()["projects"]] == [str(w["p1"])]
    assert (
        await client.get("/costs", params={"tenant_id": str(w["t1"])}, headers=auth(w["padmin"]))
    ).status_code == 403
    assert (await client.get("/costs", params={"tenant_id": str(w["t1"])}, headers=auth(w["other"]))).status_code == 404
    assert (
        await client.get("/costs", params={"project_id": str(w["p1"])}, headers=auth(w["viewer"]))
    ).status_code == 403
    r = await client.get("/budgets", params={"tenant_id": str(w["t1"])}, headers=auth(w["tadmin"]))
    assert Decimal(r.json()[0]["spent_amount"]) == Decimal("8") and len(r.json()[0]["alerts"]) == 2
    r = await client.get("/costs/breakdown", params={"tenant_id": str(w["t1"])}, headers=auth(w["op"]))
    assert r.status_code == 200 and len(r.json()) == 2
    assert {row["project_id"] for row in r.json()} == {str(w["p1"]), str(w["p1b"])}
    assert (await client.get("/costs/breakdown", headers=auth(w["tadmin"]))).status_code == 403


async def test_statements_close_ended_periods_once(h, billing, infra, auth) -> None:  # type: ignore[no-untyped-def]
    client, kit, w = billing
    this_month = month_start(now())
    last_month = month_start(this_month - timedelta(days=1))
    await set_prices(client, auth, w, frm=last_month - timedelta(days=1))
    e = h.gpu_usage(w["t1"], w["p1"], this_month - timedelta(hours=2), this_month - timedelta(hours=1), gpus=1)
    await h.publish(infra.kafka_bootstrap, [e])
    await wait_for(lambda: _is(charged(kit, w["t1"]), 1), 30, "charge")
    period = f"{last_month.year:04d}-{last_month.month:02d}"
    r = await client.post(
        "/statements/close", json={"tenant_id": str(w["t1"]), "period": period}, headers=auth(w["op"])
    )
    assert r.status_code == 201, r.text
    assert Decimal(r.json()[0]["total_amount"]) == Decimal("2.5") and r.json()[0]["currency"] == "USD"
    again = await client.post(
        "/statements/close", json={"tenant_id": str(w["t1"]), "period": period}, headers=auth(w["op"])
    )
    assert again.status_code == 409 and again.json()["code"] == "statement_already_closed"
    current = f"{this_month.year:04d}-{this_month.month:02d}"
    r = await client.post(
        "/statements/close", json={"tenant_id": str(w["t1"]), "period": current}, headers=auth(w["op"])
    )
    assert r.status_code == 422 and r.json()["code"] == "period_not_ended"
    # A late record for the closed period counts in the open one; the statement is never rewritten.
    late = h.gpu_usage(w["t1"], w["p1"], this_month - timedelta(minutes=30), this_month - timedelta(minutes=6), gpus=1)
    await h.publish(infra.kafka_bootstrap, [late])
    await wait_for(lambda: _is(charged(kit, w["t1"]), 2), 30, "late charge")
    assert (
        await q(kit, "SELECT period_start FROM charges WHERE usage_record_id = :u", u=late.data.usage_record_id)
        == this_month
    )
    r = await client.get("/statements", params={"tenant_id": str(w["t1"])}, headers=auth(w["tadmin"]))
    assert r.status_code == 200 and len(r.json()) == 1 and Decimal(r.json()[0]["total_amount"]) == Decimal("2.5")
    assert (
        await client.get("/statements", params={"tenant_id": str(w["t1"])}, headers=auth(w["other"]))
    ).status_code == 404


async def _is(value_coro, expected) -> bool:  # type: ignore[no-untyped-def]
    return (await value_coro) == expected
