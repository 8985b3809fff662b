"""Billing's business metrics on /metrics (issue 16): usage waiting for a price (the billing lag and the
unrated records), then rated when the price is published (rated counter, event→ledger delay) into a ledger
that balances (imbalance 0 per currency, no unbalanced transaction). The app runs without its consumer, so
only this test's usage reaches it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from gpuaas.billing.app import SPEC
from gpuaas.kit.testing import running, service_app
from gpuaas.kit.testing_events import platform_admin

pytestmark = pytest.mark.integration


@pytest.fixture
async def quiet_billing(infra, signer) -> AsyncIterator[tuple[Any, Any]]:
    app = await service_app(SPEC, infra.admin_url, infra.kafka_bootstrap, run_consumers=False)
    async with running(app, jwks=signer.jwks, wait_consumer=False) as (client, kit):
        yield client, kit


async def scrape(client: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    body = (await client.get("/metrics")).text
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if k != "service")): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.labels.get("service") == "billing"
    }


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def test_rating_billing_lag_and_ledger_balance(h, quiet_billing, auth) -> None:
    client, kit = quiet_billing
    op, tenant, project = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    await h.apply(kit, platform_admin(op))
    empty = await scrape(client)
    assert value(empty, "gpuaas_usage_rating_lag_seconds") == 0.0
    assert value(empty, "gpuaas_usage_unrated_records", kind="gpu") == 0.0
    assert value(empty, "gpuaas_ledger_unbalanced_transactions") == 0.0
    # two records of a model nobody has priced yet, received ten minutes ago
    start = datetime.now(UTC) - timedelta(hours=3)
    usage = [
        h.gpu_usage(
            tenant, project, start + timedelta(hours=i), start + timedelta(hours=i + 1), gpus=1, model="L40S-48GB"
        )
        for i in range(2)
    ]
    await h.apply(kit, *usage)
    async with kit.sessions() as s, s.begin():
        await s.execute(text("UPDATE usage_received SET received_at = now() - interval '10 minutes'"))
    waiting = await scrape(client)
    assert value(waiting, "gpuaas_usage_unrated_records", kind="gpu") == 2.0
    lag = value(waiting, "gpuaas_usage_rating_lag_seconds")
    assert lag is not None and 600 <= lag < 700
    assert value(waiting, "gpuaas_usage_events_rated_total", kind="gpu") is None
    # the price arrives: the waiting usage is rated at once
    price = {
        "unit": "gpu_hour",
        "unit_price": "1.10",
        "currency": "EUR",
        "gpu_model": "L40S-48GB",
        "shape": "gpu_slice",
        "effective_from": (start - timedelta(days=1)).isoformat(),
    }
    r = await client.post("/prices", json=price, headers=auth(op))
    assert r.status_code == 201 and r.json()["rated_waiting_usage"] == 2, r.text
    rated = await scrape(client)
    assert value(rated, "gpuaas_usage_events_rated_total", kind="gpu") == 2.0
    assert value(rated, "gpuaas_usage_rating_delay_seconds_count") == 2.0
    delay = value(rated, "gpuaas_usage_rating_delay_seconds_sum")
    assert delay is not None and 0 <= delay < 120  # from each usage event's time (just now) to its charge
    assert value(rated, "gpuaas_usage_unrated_records", kind="gpu") == 0.0
    assert value(rated, "gpuaas_usage_rating_lag_seconds") == 0.0
    # the ledger, checked at most once a minute: force the next scrape to check it
    kit.metrics.business._ledger_checked = float("-inf")
    balanced = await scrape(client)
    assert value(balanced, "gpuaas_ledger_imbalance", currency="EUR") == 0.0
    assert value(balanced, "gpuaas_ledger_unbalanced_transactions") == 0.0
    # a usage record applied again (redelivery) is not rated or counted twice
    await h.apply(kit, usage[0])
    assert value(await scrape(client), "gpuaas_usage_events_rated_total", kind="gpu") == 2.0
