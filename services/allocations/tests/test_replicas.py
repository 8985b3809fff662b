"""The reconciler of two replicas (plus the app's own loop, a third) on one Postgres: every lost host is marked
once (one event, one audit row), every overdue release clearance is forced once (one release task)."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import pytest
from sqlalchemy import text

from gpuaas.allocations import service
from gpuaas.allocations.reconciler import reconcile_once
from gpuaas.contracts.events.app_runtime import MemberStatus

from .conftest import World

pytestmark = pytest.mark.integration

ROUNDS = 5  # each replica's passes; they overlap with each other and with the app's 0.5 s loop


async def _replicas(w: World) -> None:
    async def replica() -> None:
        for _ in range(ROUNDS):
            await reconcile_once(w.kit)

    await asyncio.gather(replica(), replica())


async def _scalars(w: World, sql: str, **params: object) -> list:
    async with w.kit.sessions() as s:
        return list((await s.execute(text(sql), params)).all())


async def test_two_replicas_mark_each_silent_host_lost_once(world: World) -> None:
    w = world
    host_ids = [uuid.UUID((await w.enrol(f"silent-{i}"))["host_id"]) for i in range(12)]
    async with w.kit.sessions() as s, s.begin():
        # Hosts whose agents went silent an hour ago, all due at once so that the replicas contend for them.
        await s.execute(
            text(
                "UPDATE hosts SET status = 'ready', last_heartbeat_at = now() - interval '1 hour' "
                "WHERE host_id = ANY(CAST(:ids AS uuid[]))"
            ),
            {"ids": host_ids},
        )
    await _replicas(w)
    statuses = await _scalars(w, "SELECT status FROM hosts WHERE host_id = ANY(CAST(:ids AS uuid[]))", ids=host_ids)
    assert [s for (s,) in statuses] == ["unreachable"] * len(host_ids)
    events = await _scalars(
        w,
        "SELECT aggregate_id, count(*) FROM outbox WHERE event_type = 'host.heartbeat_lost' GROUP BY aggregate_id",
    )
    assert sorted(a for a, _ in events) == sorted(str(h) for h in host_ids)
    assert {n for _, n in events} == {1}, f"a host was marked lost more than once: {events}"
    audits = await _scalars(  # audit records travel through the outbox too
        w,
        "SELECT count(*) FROM outbox WHERE event_type = 'audit.recorded' "
        "AND convert_from(payload, 'UTF8')::jsonb -> 'data' ->> 'action' = 'allocations.host.heartbeat_lost' "
        "GROUP BY convert_from(payload, 'UTF8')::jsonb -> 'data' ->> 'resource_id'",
    )
    assert len(audits) == len(host_ids) and {n for (n,) in audits} == {1}


async def test_two_replicas_force_each_overdue_clearance_once(world: World) -> None:
    w = world
    await w.host_with_agent("gpu-1", "8xH100-80GB")
    aids = []
    for _ in range(4):
        aid = (await w.create("owner")).json()["allocation_id"]
        await w.wait_status("owner", aid, "active")
        aids.append(aid)
    async with w.kit.sessions() as s, s.begin():
        for aid in aids:  # app-runtime runs a member on each: the release waits for its clearance
            member = SimpleNamespace(
                member_id=uuid.uuid4(), allocation_id=uuid.UUID(aid), status=MemberStatus.active,
                tombstoned=False, version=1,
            )  # fmt: skip
            await service.record_app_member(s, member, tombstoned=False)
    async with w.client("owner") as c:
        for aid in aids:
            r = await c.post(f"/allocations/{aid}/release")
            assert r.status_code == 202 and r.json()["awaiting_release_clearance"] is True, r.text
    async with w.kit.sessions() as s, s.begin():
        # app-runtime never answered: every clearance is overdue now, all at once.
        await s.execute(
            text(
                "UPDATE allocations SET awaiting_clearance_since = now() - interval '1 hour' "
                "WHERE allocation_id = ANY(CAST(:ids AS uuid[]))"
            ),
            {"ids": [uuid.UUID(a) for a in aids]},
        )
    await _replicas(w)
    for aid in aids:
        forced = await _scalars(
            w,
            "SELECT status FROM timeline WHERE allocation_id = :a AND phase = 'release.clearance'",
            a=uuid.UUID(aid),
        )
        # 'started' when the release began waiting; one 'failed' (forced) entry per forced grant.
        assert sorted(s for (s,) in forced) == ["failed", "started"], f"{aid}: {forced}"
        releases = await _scalars(
            w, "SELECT count(*) FROM agent_tasks WHERE allocation_id = :a AND kind = 'release'", a=uuid.UUID(aid)
        )
        assert releases == [(1,)], f"{aid}: {releases[0][0]} release tasks queued"
    for aid in aids:
        await w.wait_status("owner", aid, "released")
