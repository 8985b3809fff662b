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


async def q(kit, sql: str, **params):
    async with kit.sessions() as s:
        return (await s.execute(text(sql), params)).scalar_one()


async def charged(kit, tenant) -> int:
    return await q(kit, "SELECT count(*) FROM charges WHERE tenant_id = :t", t=tenant)


async def set_prices(client, auth, w, gpu: str = "2.50", tokens: str = "0.000002", frm=None):
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


async def test_usage_is_rated_once_into_a_balanced_ledger(h, billing, infra, auth) -> None:
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


async def test_the_database_refuses_double_charges_unbalanced_and_rewritten_entries(billing) -> None:
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


async def test_the_balance_is_checked_once_per_database_transaction_over_every_touched_entry(billing) -> None:
    """billing_0003: one statement-level note per insert, one check at commit over all touched ledger
    transactions; a rolled-back savepoint takes its entries with it; nothing pending between transactions."""
    _, kit, w = billing

    def tx(t: uuid.UUID) -> str:
        return (
            "INSERT INTO ledger_transactions (transaction_id, usage_record_id, tenant_id, currency, memo) "
            f"VALUES ('{t}', '{uuid.uuid4()}', '{w['t1']}', 'USD', 'test')"
        )

    def entries(*rows: tuple[uuid.UUID, str, str]) -> str:
        values = ", ".join(f"('{uuid.uuid4()}', '{t}', 'a', '{side}', {amount}, 'USD')" for t, side, amount in rows)
        return f"INSERT INTO ledger_entries (entry_id, transaction_id, account, side, amount, currency) VALUES {values}"

    good, bad, later = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    # One statement with many ledger transactions, one of them unbalanced: the commit refuses all of it.
    with pytest.raises(DBAPIError, match=f"ledger transaction {bad} does not balance"):
        async with kit.sessions() as s, s.begin():
            for t in (good, bad):
                await s.execute(text(tx(t)))
            await s.execute(text(entries((good, "debit", "5"), (good, "credit", "5"), (bad, "debit", "3"))))
            await s.execute(text(entries((bad, "credit", "2.99"))))
    assert await q(kit, "SELECT count(*) FROM ledger_transactions WHERE transaction_id IN (:a, :b)", a=good, b=bad) == 0
    # Balanced over several statements; an unbalanced part in a rolled-back savepoint leaves no trace.
    async with kit.sessions() as s, s.begin():
        for t in (good, later):
            await s.execute(text(tx(t)))
        await s.execute(text(entries((good, "debit", "5"))))
        with pytest.raises(DBAPIError, match="boom"):
            async with s.begin_nested():
                await s.execute(text(entries((later, "debit", "1"))))
                await s.execute(text("DO $$ BEGIN RAISE EXCEPTION 'boom'; END $$"))
        await s.execute(text(entries((good, "credit", "5"), (later, "debit", "1"), (later, "credit", "1"))))
    assert await q(kit, "SELECT count(*) FROM ledger_entries WHERE transaction_id IN (:a, :b)", a=good, b=later) == 4
    assert await q(kit, "SELECT count(*) FROM ledger_balance_pending") == 0
    # A later database transaction adding an unbalancing entry to a committed ledger transaction is refused.
    with pytest.raises(DBAPIError, match=f"ledger transaction {good} does not balance"):
        async with kit.sessions() as s, s.begin():
            await s.execute(text(entries((good, "debit", "0.01"))))


async def test_usage_without_a_price_waits_and_is_rated_when_one_is_published(h, billing, infra, auth) -> None:
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


async def test_budgets_alert_once_per_threshold_and_costs_split_per_project(h, billing, auth) -> None:
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
    await h.apply(kit, e1, e2)
    assert await charged(kit, w["t1"]) == 2
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


async def test_statements_close_ended_periods_once(h, billing, auth) -> None:
    client, kit, w = billing
    this_month = month_start(now())
    last_month = month_start(this_month - timedelta(days=1))
    await set_prices(client, auth, w, frm=last_month - timedelta(days=1))
    e = h.gpu_usage(w["t1"], w["p1"], this_month - timedelta(hours=2), this_month - timedelta(hours=1), gpus=1)
    await h.apply(kit, e)
    assert await charged(kit, w["t1"]) == 1
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
    await h.apply(kit, late)
    assert await charged(kit, w["t1"]) == 2
    assert (
        await q(kit, "SELECT period_start FROM charges WHERE usage_record_id = :u", u=late.data.usage_record_id)
        == this_month
    )
    r = await client.get("/statements", params={"tenant_id": str(w["t1"])}, headers=auth(w["tadmin"]))
    assert r.status_code == 200 and len(r.json()) == 1 and Decimal(r.json()[0]["total_amount"]) == Decimal("2.5")
    assert (
        await client.get("/statements", params={"tenant_id": str(w["t1"])}, headers=auth(w["other"]))
    ).status_code == 404


async def test_a_statement_is_read_only_within_its_tenant(h, billing, auth) -> None:
    client, kit, w = billing
    this_month = month_start(now())
    last_month = month_start(this_month - timedelta(days=1))
    await set_prices(client, auth, w, frm=last_month - timedelta(days=1))
    await h.apply(kit, h.gpu_usage(w["t1"], w["p1"], last_month, last_month + timedelta(hours=1), gpus=1))
    period = f"{last_month.year:04d}-{last_month.month:02d}"
    r = await client.post(
        "/statements/close", json={"tenant_id": str(w["t1"]), "period": period}, headers=auth(w["op"])
    )
    assert r.status_code == 201, r.text
    statement_id = r.json()[0]["statement_id"]
    own = await client.get(f"/statements/{statement_id}", headers=auth(w["tadmin"]))
    assert own.status_code == 200 and own.json()["tenant_id"] == str(w["t1"])
    assert Decimal(own.json()["total_amount"]) == Decimal("2.5")
    # Another tenant's admin is answered as if the statement did not exist (404), never with its content.
    other = await client.get(f"/statements/{statement_id}", headers=auth(w["other"]))
    assert other.status_code == 404 and other.headers["content-type"].startswith("application/problem+json")
    assert set(other.json()) <= {"type", "title", "status", "detail", "code", "instance", "correlation_id"}
    unknown = await client.get(f"/statements/{uuid.uuid4()}", headers=auth(w["other"]))
    assert unknown.status_code == 404 and unknown.json()["code"] == "statement_not_found"


async def test_a_new_price_rates_usage_from_its_start_and_earlier_usage_keeps_the_old_one(h, billing, auth) -> None:
    client, kit, w = billing
    switch = now().replace(microsecond=0) - timedelta(hours=2)
    await set_prices(client, auth, w, gpu="2.00", frm=switch - timedelta(days=10))
    body = {"unit": "gpu_hour", "currency": "USD", "gpu_model": "H100-80GB", "shape": "gpu_slice"}
    r = await client.post(
        "/prices", json={**body, "unit_price": "3.00", "effective_from": switch.isoformat()}, headers=auth(w["op"])
    )
    assert r.status_code == 201, r.text
    new_price = r.json()["price_id"]
    before = h.gpu_usage(w["t1"], w["p1"], switch - timedelta(hours=1), switch, gpus=1)
    # A price applies to usage that *started* in its range: this hour straddles the switch, yet is old-priced.
    straddling = h.gpu_usage(w["t1"], w["p1"], switch - timedelta(seconds=1), switch + timedelta(seconds=3599), gpus=1)
    at_switch = h.gpu_usage(w["t1"], w["p1"], switch, switch + timedelta(minutes=30), gpus=1)
    await h.apply(kit, before, straddling, at_switch)
    charged_at = {
        e.data.usage_record_id: (
            await q(kit, "SELECT unit_price FROM charges WHERE usage_record_id = :u", u=e.data.usage_record_id),
            await q(kit, "SELECT amount FROM charges WHERE usage_record_id = :u", u=e.data.usage_record_id),
        )
        for e in (before, straddling, at_switch)
    }
    assert charged_at[before.data.usage_record_id] == (Decimal("2.00"), Decimal("2.000000"))
    assert charged_at[straddling.data.usage_record_id] == (Decimal("2.00"), Decimal("2.000000"))
    assert charged_at[at_switch.data.usage_record_id] == (Decimal("3.00"), Decimal("1.500000"))
    assert (
        str(await q(kit, "SELECT price_id FROM charges WHERE usage_record_id = :u", u=at_switch.data.usage_record_id))
        == new_price
    )
    # The price book shows the old price ending where the new one starts; only the new one is current.
    sku = "gpu-hour.H100-80GB.gpu_slice"
    book = (await client.get("/prices", params={"sku": sku}, headers=auth(w["viewer"]))).json()
    assert [Decimal(p["unit_price"]) for p in book] == [Decimal("2.00"), Decimal("3.00")]
    assert datetime.fromisoformat(book[0]["effective_to"]) == switch and book[1]["effective_to"] is None
    current = (await client.get("/prices", params={"sku": sku, "current": True}, headers=auth(w["viewer"]))).json()
    assert [p["price_id"] for p in current] == [new_price]
    # A price may not start before usage already charged at the current one: charges are never rewritten.
    r = await client.post(
        "/prices",
        json={**body, "unit_price": "4.00", "effective_from": (switch + timedelta(minutes=1)).isoformat()},
        headers=auth(w["op"]),
    )
    assert r.status_code == 201  # after the last charged usage start (the switch): accepted
    r = await client.post(
        "/prices", json={**body, "unit_price": "5.00", "effective_from": switch.isoformat()}, headers=auth(w["op"])
    )
    assert r.status_code == 409 and r.json()["code"] == "price_not_after_current"


async def test_amounts_are_rounded_half_even_to_six_decimals_and_totals_are_exact_sums(h, billing, auth) -> None:
    """The rule of domain.rate: amounts to 0.000001 ROUND_HALF_EVEN (ties go to the even digit), quantities to
    9 decimals; views and statements add the rounded charges, so a total is exactly the sum of its lines."""
    client, kit, w = billing
    start = month_start(now()) + timedelta(minutes=1)
    await set_prices(client, auth, w, tokens="0.0000005", frm=start - timedelta(days=40))
    # tokens x 0.0000005 = exact ties at the 7th decimal: half-even -> 0, 0.000002, 0.000002, 0.000004
    # (half-up would give 0.000001, 0.000002, 0.000003, 0.000005).
    tokens = {"1": "0.000000", "3": "0.000002", "5": "0.000002", "9": "0.000004"}
    app = [h.app_usage(w["t1"], w["p1"], start, n, f"tie-{n}") for n in tokens]
    # 1 GPU-second at 2.50/h = 0.000694444... USD, 0.000277777... GPU-hour.
    gpu = h.gpu_usage(w["t1"], w["p1"], start, start + timedelta(seconds=1), gpus=1)
    await h.apply(kit, *app, gpu)
    for e, expected in zip(app, tokens.values(), strict=True):
        amount = await q(kit, "SELECT amount FROM charges WHERE usage_record_id = :u", u=e.data.app_usage_record_id)
        assert amount == Decimal(expected), (e.data.quantity, amount)
    assert await q(kit, "SELECT amount FROM charges WHERE usage_record_id = :u", u=gpu.data.usage_record_id) == Decimal(
        "0.000694"
    )
    assert await q(
        kit, "SELECT quantity FROM charges WHERE usage_record_id = :u", u=gpu.data.usage_record_id
    ) == Decimal("0.000277778")
    r = await client.get("/costs", params={"project_id": str(w["p1"])}, headers=auth(w["padmin"]))
    assert r.status_code == 200, r.text
    project = r.json()["projects"][0]
    assert Decimal(project["app_amount"]) == Decimal("0.000008")
    assert Decimal(project["gpu_amount"]) == Decimal("0.000694")
    assert Decimal(project["amount"]) == Decimal("0.000702")
    r = await client.get("/ledger/balance", headers=auth(w["op"]))
    assert r.json()["balanced"] is True


async def _is(value_coro, expected) -> bool:
    return (await value_coro) == expected
