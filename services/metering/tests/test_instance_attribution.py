"""Issue 19: GPU usage records name the app instance whose members ran on the allocation in the window (so
billing's GPU charges carry it and an instance's cost is more than its app usage), and app usage posted for
another project's instance answers `instance_not_found` like every other instance lookup."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, text

from gpuaas.contracts.events import app_runtime as app_runtime_events
from gpuaas.metering.domain import hour_floor
from gpuaas.metering.models import usage_records

pytestmark = pytest.mark.integration


def member_event(
    w: dict[str, uuid.UUID],
    instance_id: uuid.UUID,
    allocation_id: uuid.UUID,
    at: datetime,
    *,
    member_id: uuid.UUID | None = None,
    tombstoned: bool = False,
    version: int = 1,
) -> app_runtime_events.MemberUpdated:
    state = app_runtime_events.MemberState(
        member_id=member_id or uuid.uuid4(),
        instance_id=instance_id,
        tenant_id=w["t1"],
        project_id=w["p1"],
        component_key="worker",
        allocation_id=allocation_id,
        status="removed" if tombstoned else "active",
        status_changed_at=at,
        tombstoned=tombstoned,
        version=version,
    )
    cls = app_runtime_events.MemberTombstoned if tombstoned else app_runtime_events.MemberAdded
    return cls.build(data=state, source="app-runtime")


async def windows(kit, allocation_id: uuid.UUID) -> list[uuid.UUID | None]:
    async with kit.sessions() as s:
        rows = await s.execute(
            select(usage_records.c.instance_id)
            .where(usage_records.c.allocation_id == allocation_id)
            .order_by(usage_records.c.window_start)
        )
        return [r[0] for r in rows]


async def recorded_events(kit, allocation_id: uuid.UUID) -> list[dict]:
    async with kit.sessions() as s:
        rows = await s.execute(
            text("SELECT payload FROM outbox WHERE event_type = 'usage.recorded' AND aggregate_id = :a ORDER BY seq"),
            {"a": str(allocation_id)},
        )
        return [json.loads(r[0])["data"] for r in rows]


async def test_gpu_usage_records_name_the_instance_running_on_the_allocation(h, metering) -> None:
    _client, kit, w = metering
    start = hour_floor(datetime.now(UTC)) - timedelta(hours=3)
    inst, inst2 = uuid.uuid4(), uuid.uuid4()
    e_app, app_alloc = h.new_allocation(w["t1"], w["p1"], start)
    e_plain, plain = h.new_allocation(w["t1"], w["p1"], start)
    e_shared, shared = h.new_allocation(w["t1"], w["p1"], start)
    e_left, left = h.new_allocation(w["t1"], w["p1"], start)
    leaver = uuid.uuid4()
    await h.apply(
        kit,
        e_app,
        e_plain,
        e_shared,
        e_left,
        member_event(w, inst, app_alloc.allocation_id, start - timedelta(minutes=1)),
        member_event(w, inst, shared.allocation_id, start - timedelta(minutes=1)),
        member_event(w, inst2, shared.allocation_id, start - timedelta(minutes=1)),
        member_event(w, inst, left.allocation_id, start - timedelta(minutes=1), member_id=leaver),
        member_event(
            w, inst, left.allocation_id, start + timedelta(minutes=30), member_id=leaver, tombstoned=True, version=2
        ),
    )
    await h.close_windows(kit, at=start + timedelta(hours=2))

    assert await windows(kit, app_alloc.allocation_id) == [inst, inst]  # was [None, None]
    assert [e["instance_id"] for e in await recorded_events(kit, app_alloc.allocation_id)] == [str(inst)] * 2
    assert await windows(kit, plain.allocation_id) == [None, None]  # no app on it
    assert await windows(kit, shared.allocation_id) == [None, None]  # two instances: not one instance's cost
    assert await windows(kit, left.allocation_id) == [inst, None]  # the member left in the first hour


async def test_app_usage_for_another_projects_instance_is_instance_not_found(h, metering, auth) -> None:
    client, kit, w = metering
    e = h.instance_created(w["t1"], w["p1"], datetime.now(UTC) - timedelta(days=1))
    await h.apply(kit, e)
    body = {
        "instance_id": str(e.data.instance_id),
        "unit": "tokens",
        "quantity": "10",
        "idempotency_key": "k",
        "occurred_at": (datetime.now(UTC) - timedelta(minutes=1)).isoformat(),
    }
    sa2 = auth(w["sa2"], kind="service_account", project_id=str(w["p2"]), scope="app-controller")
    for who in (sa2, auth(w["other"])):
        r = await client.post("/usage/app", json=body, headers=who)
        assert r.status_code == 404 and r.json()["code"] == "instance_not_found", r.text  # was not_found
    missing = await client.post("/usage/app", json={**body, "instance_id": str(uuid.uuid4())}, headers=sa2)
    assert missing.json()["code"] == "instance_not_found"
    assert missing.json()["detail"] == r.json()["detail"]  # the same answer: existence is not revealed
