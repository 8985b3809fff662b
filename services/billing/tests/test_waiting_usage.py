"""Issue 19: usage that arrived before its SKU had any price is rated when the first price is published
(whatever its `effective_from`), exactly once; late usage dated before the first price is rated at it
too; GPU charges carry the app instance their usage record names."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import text

from gpuaas.contracts.events import usage as usage_events
from gpuaas.kit.testing import wait_for

pytestmark = pytest.mark.integration


def now() -> datetime:
    return datetime.now(UTC)


async def q(kit, sql: str, **params):
    async with kit.sessions() as s:
        return (await s.execute(text(sql), params)).scalar_one()


async def test_usage_before_its_first_price_is_rated_once_when_it_arrives(h, billing, infra, auth) -> None:
    client, kit, w = billing
    slug = f"app-{uuid.uuid4().hex[:6]}"
    instance = uuid.uuid4()
    early = h.app_usage(w["t1"], w["p1"], now() - timedelta(minutes=10), "1000", "early", instance=instance, slug=slug)
    await h.publish(infra.kafka_bootstrap, [early])
    rec = early.data.app_usage_record_id

    async def received() -> bool:
        return await q(kit, "SELECT count(*) FROM usage_received WHERE usage_record_id = :u", u=rec) == 1

    await wait_for(received, 30, "usage received")
    assert await q(kit, "SELECT count(*) FROM charges WHERE usage_record_id = :u", u=rec) == 0

    # the operator publishes the price now (effective from now): the usage from before it was waiting for it
    body = {"unit": "tokens", "unit_price": "0.01", "currency": "USD", "app_slug": slug}
    r = await client.post("/prices", json=body, headers=auth(w["op"]))
    assert r.status_code == 201, r.text
    assert r.json()["rated_waiting_usage"] == 1  # was 0: never rated
    assert await q(kit, "SELECT amount FROM charges WHERE usage_record_id = :u", u=rec) == Decimal("10.000000")
    assert await q(kit, "SELECT status FROM usage_received WHERE usage_record_id = :u", u=rec) == "rated"

    # late usage dated before the first price: rated at it on arrival
    late = h.app_usage(w["t1"], w["p1"], now() - timedelta(minutes=20), "500", "late", instance=instance, slug=slug)
    await h.apply(kit, late)
    assert await q(
        kit, "SELECT amount FROM charges WHERE usage_record_id = :u", u=late.data.app_usage_record_id
    ) == Decimal("5.000000")

    # a later price rates nothing again; every usage is charged exactly once
    r = await client.post(
        "/prices",
        json={**body, "unit_price": "0.02", "effective_from": (now() + timedelta(seconds=1)).isoformat()},
        headers=auth(w["op"]),
    )
    assert r.status_code == 201 and r.json()["rated_waiting_usage"] == 0, r.text
    await h.apply(kit, early, late)  # replays change nothing
    assert await q(kit, "SELECT count(*) FROM charges WHERE instance_id = :i", i=instance) == 2
    assert (
        await q(
            kit,
            "SELECT count(*) FROM ledger_entries WHERE transaction_id IN "
            "(SELECT transaction_id FROM charges WHERE instance_id = :i)",
            i=instance,
        )
        >= 4
    )


async def test_gpu_charges_carry_the_instance_of_their_usage_record(h, billing, auth) -> None:
    client, kit, w = billing
    start = now().replace(microsecond=0) - timedelta(hours=2)
    r = await client.post(
        "/prices",
        json={
            "unit": "gpu_hour",
            "unit_price": "2.00",
            "currency": "USD",
            "gpu_model": "H100-80GB",
            "shape": "gpu_slice",
            "effective_from": (start - timedelta(days=1)).isoformat(),
        },
        headers=auth(w["op"]),
    )
    assert r.status_code == 201, r.text
    instance = uuid.uuid4()
    base = h.gpu_usage(w["t1"], w["p1"], start, start + timedelta(hours=1), gpus=1).data
    gpu = usage_events.UsageRecorded.build(
        data=usage_events.UsageRecord(**(base.model_dump() | {"instance_id": instance})), source="metering"
    )
    plain = h.gpu_usage(w["t1"], w["p1"], start, start + timedelta(hours=1), gpus=1)
    app = h.app_usage(w["t1"], w["p1"], start + timedelta(minutes=5), "1", "k", instance=instance)
    await h.apply(kit, gpu, plain, app)
    got = await client.get(
        "/charges", params={"project_id": str(w["p1"]), "instance_id": str(instance)}, headers=auth(w["padmin"])
    )
    assert got.status_code == 200, got.text
    items = got.json()
    kinds = sorted(c["usage_kind"] for c in items)
    assert kinds == ["gpu"], items  # the instance's GPU time (no app price for vllm tokens here)
    assert items[0]["allocation_id"] == str(gpu.data.allocation_id) and items[0]["instance_id"] == str(instance)
    assert (
        await q(kit, "SELECT instance_id FROM charges WHERE usage_record_id = :u", u=plain.data.usage_record_id) is None
    )
