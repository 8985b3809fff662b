"""Issue 21: spend per day of a billing period (`GET /costs/daily`), the console's spend chart and
`gpuaas cost --by day`: days add up to `GET /costs`, GPU time and app usage apart, the scope's budgets
alongside, and the same scope rules as `/costs`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

pytestmark = pytest.mark.integration


async def test_daily_series_adds_up_to_the_period_cost(h, billing, auth) -> None:
    client, kit, w = billing
    op = auth(w["op"])
    for body in (
        {"unit": "gpu_hour", "unit_price": "2.50", "currency": "USD", "gpu_model": "H100-80GB", "shape": "gpu_slice"},
        {"unit": "tokens", "unit_price": "0.001", "currency": "USD", "app_slug": "vllm"},
    ):
        r = await client.post("/prices", json={**body, "effective_from": "2026-01-01T00:00:00+00:00"}, headers=op)
        assert r.status_code == 201, r.text
    day1 = datetime(2026, 3, 3, 22, tzinfo=UTC)
    day2 = datetime(2026, 3, 5, 9, tzinfo=UTC)
    await h.apply(
        kit,
        # 2 GPUs x 1 h on 3 March (5.00), 1 GPU x 1 h on 5 March (2.50) in p1; 2 GPUs x 30 min in p1b (2.50)
        h.gpu_usage(w["t1"], w["p1"], day1, day1 + timedelta(hours=1)),
        h.gpu_usage(w["t1"], w["p1"], day2, day2 + timedelta(hours=1), gpus=1),
        h.gpu_usage(w["t1"], w["p1b"], day2, day2 + timedelta(minutes=30)),
        # 1000 tokens on 5 March (1.00), and usage of the next period, which March's series leaves out
        h.app_usage(w["t1"], w["p1"], day2, "1000", "k1"),
        h.gpu_usage(w["t1"], w["p1"], datetime(2026, 4, 1, 1, tzinfo=UTC), datetime(2026, 4, 1, 2, tzinfo=UTC)),
    )
    r = await client.post(
        "/budgets",
        json={"tenant_id": str(w["t1"]), "name": "march", "limit_amount": "20", "currency": "USD"},
        headers=auth(w["tadmin"]),
    )
    assert r.status_code == 201, r.text

    march = {"tenant_id": str(w["t1"]), "period": "2026-03"}
    r = await client.get("/costs/daily", params=march, headers=auth(w["tadmin"]))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["period_start"].startswith("2026-03-01") and body["period_end"].startswith("2026-04-01")
    days = {d["day"]: (Decimal(d["gpu_amount"]), Decimal(d["app_amount"]), Decimal(d["amount"])) for d in body["days"]}
    assert days == {
        "2026-03-03": (Decimal("5"), Decimal("0"), Decimal("5")),
        "2026-03-05": (Decimal("5"), Decimal("1"), Decimal("6")),
    }
    assert {d["currency"] for d in body["days"]} == {"USD"}
    assert [(b["name"], Decimal(b["limit_amount"]), b["currency"]) for b in body["budgets"]] == [
        ("march", Decimal("20"), "USD")
    ]
    costs = await client.get("/costs", params={"tenant_id": str(w["t1"]), "period": "2026-03"}, headers=op)
    assert sum(v[2] for v in days.values()) == Decimal(costs.json()["totals"][0]["amount"]) == Decimal("11")

    # A project admin sees their project's days only (no tenant-wide budget line); others are refused.
    p1_march = {"project_id": str(w["p1"]), "period": "2026-03"}
    r = await client.get("/costs/daily", params=p1_march, headers=auth(w["padmin"]))
    assert r.status_code == 200, r.text
    assert {d["day"]: Decimal(d["amount"]) for d in r.json()["days"]} == {
        "2026-03-03": Decimal("5"),
        "2026-03-05": Decimal("3.5"),
    }
    assert r.json()["budgets"] == [] and r.json()["project_id"] == str(w["p1"])
    april = await client.get("/costs/daily", params={"project_id": str(w["p1"]), "period": "2026-04"}, headers=op)
    assert [(d["day"], Decimal(d["amount"])) for d in april.json()["days"]] == [("2026-04-01", Decimal("5"))]
    for who, params, status in (
        ("padmin", {"tenant_id": str(w["t1"])}, 403),
        ("viewer", {"project_id": str(w["p1"])}, 403),
        ("other", {"tenant_id": str(w["t1"])}, 404),
    ):
        assert (await client.get("/costs/daily", params=params, headers=auth(w[who]))).status_code == status, who
    r = await client.get("/costs/daily", headers=op)
    assert r.status_code == 422 and r.json()["code"] == "scope_required"
    r = await client.get("/costs/daily", params={"tenant_id": str(w["t1"]), "period": "2026-13"}, headers=op)
    assert r.status_code == 422
