"""The app usage producer API: idempotent per key, late events within the window, out-of-window refused."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from gpuaas.contracts.events import app_runtime as app_runtime_events
from gpuaas.contracts.events.usage import app_usage_record_id
from gpuaas.kit.testing import wait_for
from gpuaas.metering.models import instances

pytestmark = pytest.mark.integration


def now() -> datetime:
    return datetime.now(UTC)


async def known(kit, instance_id) -> bool:
    async with kit.sessions() as s:
        return (await s.execute(instances.select().where(instances.c.instance_id == instance_id))).first() is not None


async def outbox_app_usage(kit, instance_id) -> int:
    async with kit.sessions() as s:
        return (
            await s.execute(
                text("SELECT count(*) FROM outbox WHERE event_type = 'app_usage.recorded' AND aggregate_id = :i"),
                {"i": str(instance_id)},
            )
        ).scalar_one()


@pytest.fixture
async def instance(h, metering, infra):
    _client, kit, w = metering
    e = h.instance_created(w["t1"], w["p1"], now() - timedelta(days=1))
    await h.publish(infra.kafka_bootstrap, [e])
    # Bounded generously: the module's runtime joins its consumer group first (seconds, tens of them on a loaded
    # 2-core machine: a CI-like run timed out at 30 s); the projection itself is what other tests measure.
    await wait_for(lambda: known(kit, e.data.instance_id), 90, "instance projected")
    return e.data.instance_id


def body(instance_id, key: str, **kw):
    return {
        "instance_id": str(instance_id),
        "unit": "tokens",
        "quantity": "1500",
        "idempotency_key": key,
        "occurred_at": (now() - timedelta(minutes=1)).isoformat(),
        **kw,
    }


async def test_post_twice_records_once_and_conflicting_reuse_is_refused(metering, instance, auth) -> None:
    client, kit, w = metering
    sa = auth(w["sa"], kind="service_account", project_id=str(w["p1"]), scope="app-controller")
    b = body(instance, "req-1")
    first = await client.post("/usage/app", json=b, headers=sa)
    assert first.status_code == 201, first.text
    assert first.json()["app_usage_record_id"] == str(app_usage_record_id(instance, "req-1"))
    assert first.json()["app_slug"] == "vllm" and first.json()["duplicate"] is False
    again = await client.post("/usage/app", json=b, headers=sa)
    assert again.status_code == 200 and again.json()["duplicate"] is True
    # Concurrent duplicates: still one record.
    rs = await asyncio.gather(
        *[
            client.post("/usage/app", json=body(instance, "req-2", occurred_at=b["occurred_at"]), headers=sa)
            for _ in range(8)
        ]
    )
    assert sorted(r.status_code for r in rs) == [200] * 7 + [201]
    other = await client.post("/usage/app", json={**b, "quantity": "9"}, headers=sa)
    assert other.status_code == 409 and other.json()["code"] == "idempotency_key_reused"
    assert await outbox_app_usage(kit, instance) == 2


async def test_late_events_within_the_window_are_accepted_and_older_ones_refused(metering, instance, auth) -> None:
    client, kit, w = metering
    sa = auth(w["sa"], kind="service_account", project_id=str(w["p1"]), scope="app-controller")
    late = await client.post(
        "/usage/app", json=body(instance, "late", occurred_at=(now() - timedelta(minutes=55)).isoformat()), headers=sa
    )
    assert late.status_code == 201, late.text
    old = await client.post(
        "/usage/app", json=body(instance, "old", occurred_at=(now() - timedelta(hours=3)).isoformat()), headers=sa
    )
    assert old.status_code == 422 and old.json()["code"] == "usage_out_of_window"
    assert "accepted_from" in old.json() and old.headers["content-type"].startswith("application/problem+json")
    future = await client.post(
        "/usage/app", json=body(instance, "future", occurred_at=(now() + timedelta(hours=1)).isoformat()), headers=sa
    )
    assert future.status_code == 422 and future.json()["code"] == "usage_out_of_window"
    assert await outbox_app_usage(kit, instance) == 1


async def test_bad_input_and_access_are_problems_not_writes(metering, instance, auth) -> None:
    client, kit, w = metering
    sa = auth(w["sa"], kind="service_account", project_id=str(w["p1"]), scope="app-controller")
    for bad in (
        {"quantity": "-1"},
        {"quantity": "abc"},
        {"unit": "gpu_hours"},
        {"occurred_at": "2026-01-01T00:00:00"},
        {"idempotency_key": ""},
        {"quantity": "NaN"},
    ):
        r = await client.post("/usage/app", json=body(instance, "bad", **bad), headers=sa)
        assert r.status_code == 422, (bad, r.text)
    r = await client.post("/usage/app", json=body(uuid.uuid4(), "k"), headers=sa)
    assert r.status_code == 404 and r.json()["code"] == "instance_not_found"
    # Another tenant's controller does not learn the instance exists.
    sa2 = auth(w["sa2"], kind="service_account", project_id=str(w["p2"]), scope="app-controller")
    r = await client.post("/usage/app", json=body(instance, "k"), headers=sa2)
    assert r.status_code == 404
    # A viewer may read, not write; an operator may backfill.
    r = await client.post("/usage/app", json=body(instance, "k"), headers=auth(w["viewer"]))
    assert r.status_code == 403
    r = await client.post("/usage/app", json=body(instance, "k"), headers=auth(w["op"]))
    assert r.status_code == 201
    r = await client.get("/usage/app", params={"instance_id": str(instance)}, headers=auth(w["viewer"]))
    assert r.status_code == 200 and len(r.json()) == 1
    r = await client.get("/usage/app", params={"project_id": str(w["p1"])}, headers=auth(w["other"]))
    assert r.status_code == 404
    assert await outbox_app_usage(kit, instance) == 1


async def test_a_usage_report_may_name_only_a_member_of_its_instance(h, metering, instance, auth) -> None:
    """Issue 17: `member_id` was stored unchecked; now it must be a member of the reported instance (as
    metering's projection of app-runtime's member events knows them)."""
    client, kit, w = metering
    sa = auth(w["sa"], kind="service_account", project_id=str(w["p1"]), scope="app-controller")
    other_instance = h.instance_created(w["t1"], w["p1"], now() - timedelta(days=1))
    mine, theirs = uuid.uuid4(), uuid.uuid4()
    for member_id, instance_id in ((mine, instance), (theirs, other_instance.data.instance_id)):
        state = app_runtime_events.MemberState(
            member_id=member_id,
            instance_id=instance_id,
            tenant_id=w["t1"],
            project_id=w["p1"],
            component_key="worker",
            allocation_id=uuid.uuid4(),
            status="active",
            status_changed_at=now(),
            version=1,
        )
        await h.apply(kit, app_runtime_events.MemberAdded.build(data=state, source="app-runtime"))
    for member_id in (uuid.uuid4(), theirs):
        r = await client.post("/usage/app", json=body(instance, f"m-{member_id}", member_id=str(member_id)), headers=sa)
        assert r.status_code == 404 and r.json()["code"] == "member_not_found", r.text
    r = await client.post("/usage/app", json=body(instance, "m-mine", member_id=str(mine)), headers=sa)
    assert r.status_code == 201 and r.json()["member_id"] == str(mine), r.text
    assert await outbox_app_usage(kit, instance) == 1
