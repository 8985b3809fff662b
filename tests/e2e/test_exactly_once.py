"""Exactly-once across real processes: allocations commits events through its outbox, identity
applies them (its audit store, an append-only effect that would show any duplicate).

(a) normally, through the public API;
(b) identity SIGKILLed in the middle of a batch and restarted;
(c) the allocations relay killed after the broker acknowledged a batch but before marking it sent;
(d) the broker restarted (Tansu loses its whole log) and the outbox range replayed.
"""

from __future__ import annotations

import asyncio
import re
import signal
import uuid

import pytest

from gpuaas.contracts import Actor
from gpuaas.contracts.events.audit import AuditRecord, AuditRecorded
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually
from gpuaas.kit.db import create_engine, session_factory
from gpuaas.kit.outbox import add_events

pytestmark = pytest.mark.e2e


KEYS = 16  # the run's events are spread over this many aggregates (Kafka keys)


async def commit_through_outbox(
    stack: Stack, run: str, n: int, per_tx: int = 200, first: int = 0, service: str | None = None
) -> None:
    """Commit `n` events in allocations' outbox with allocations' own role, as its use cases do: keyed
    `{run}-0` .. `{run}-15`, stored by identity under `service` (default: `run`)."""
    engine = create_engine(stack.database_url("allocations"), "allocations", pool_size=2)
    sessions = session_factory(engine)
    try:
        for start in range(first, first + n, per_tx):
            async with sessions() as s, s.begin():
                await add_events(
                    s,
                    [
                        AuditRecorded.build(
                            subject=f"{run}-{i % KEYS}",
                            source="allocations",
                            actor=Actor.system("e2e"),
                            data=AuditRecord(
                                service=service or run, action="e2e.write", resource_type="probe", resource_id=str(i)
                            ),
                        )
                        for i in range(start, min(start + per_tx, first + n))
                    ],
                )
    finally:
        await engine.dispose()


async def applied(stack: Stack, run: str) -> tuple[int, int]:
    """(rows, distinct probes) that identity stored for this run. The store's unique event id would turn
    a second application into a dead letter instead of a row: `no_dead_letters` checks that side."""
    row = await stack.fetch(
        "identity", "SELECT count(*) AS n, count(DISTINCT resource_id) AS d FROM audit_records WHERE service = $1", run
    )
    return row[0]["n"], row[0]["d"]


async def drained(stack: Stack, run: str) -> None:
    """Probes behind the run's events: one per key of the run, committed after them, so each follows them
    through the outbox (seq order) into the same partition. Once identity has stored every probe, it has
    consumed everything the run put before them: a redelivered copy still in flight would show by now."""
    probes = f"{run}-probe"
    await commit_through_outbox(stack, run, KEYS, service=probes)
    await eventually(lambda: _is(applied(stack, probes), (KEYS, KEYS)), 120, "the probes behind the run's events")


async def metric(stack: Stack, service: str, name: str) -> float:
    import httpx

    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{stack.service_url(service)}/metrics")).text
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


async def test_a_event_applied_exactly_once_normally(stack: Stack, gw) -> None:
    run = uuid.uuid4().hex[:8]
    created = await asyncio.gather(
        *[
            gw.post(
                "/api/allocations/hosts",
                json={"name": f"host-{run}-{i}", "gpus": [{"index": 0, "model": "H100-80GB", "memory_mb": 81559}]},
            )
            for i in range(40)
        ]
    )
    assert all(r.status_code == 201 for r in created), [r.text for r in created if r.status_code != 201][:2]
    host_ids = {r.json()["host_id"] for r in created}

    async def stored() -> bool:
        rows = await stack.fetch(
            "identity",
            "SELECT resource_id FROM audit_records WHERE action = 'allocations.host.enroll' AND resource_id = ANY($1)",
            list(host_ids),
        )
        return len(rows) == len(host_ids)

    await eventually(stored, 60, "audit records of all enrolled hosts")
    # Readable through the public API as well, and each exactly once.
    r = await gw.get("/api/identity/audit", params={"action": "allocations.host.enroll", "limit": 1000})
    ours = [e["resource_id"] for e in r.json()["items"] if e["resource_id"] in host_ids]
    assert sorted(ours) == sorted(host_ids)
    await no_dead_letters(stack)


async def test_b_consumer_sigkilled_mid_batch(stack: Stack) -> None:
    run = uuid.uuid4().hex[:8]
    n = 3000
    await asyncio.to_thread(stack.kill, "identity", signal.SIGKILL)
    await commit_through_outbox(stack, run, n)
    await asyncio.to_thread(stack.start_service, "identity", False)

    async def partly() -> int:
        rows, _ = await applied(stack, run)
        return rows

    seen = await eventually(partly, 120, "the first applied batch", interval_s=0.01)
    await asyncio.to_thread(stack.kill, "identity", signal.SIGKILL)
    assert 0 < seen < n, f"the kill did not land mid-stream ({seen}/{n})"
    await asyncio.to_thread(stack.start_service, "identity")
    await eventually(lambda: _is(applied(stack, run), (n, n)), 120, f"{n} events applied once")
    await drained(stack, run)  # anything left in flight would show up as a duplicate now
    assert await applied(stack, run) == (n, n)
    await no_dead_letters(stack)


async def test_c_relay_killed_after_publish_before_mark(stack: Stack) -> None:
    run = uuid.uuid4().hex[:8]
    n = 250
    # Armed for a batch of the test's size: stragglers published at the restart do not set it off.
    fault = {"GPUAAS_FAULT_RELAY_KILL_AFTER_PUBLISH": str(n)}
    stack.config.env.setdefault("allocations", {}).update(fault)
    try:
        await asyncio.to_thread(stack.stop, "allocations")
        await asyncio.to_thread(stack.start_service, "allocations")
        await commit_through_outbox(stack, run, n, per_tx=n)
        await eventually(
            lambda: _not(asyncio.to_thread(stack.is_running, "allocations")),
            60,
            "the relay to kill its process after publishing",
        )
    finally:
        for key in fault:
            stack.config.env["allocations"].pop(key, None)
    unsent = await stack.fetchval("allocations", "SELECT count(*) FROM outbox WHERE sent_at IS NULL")
    assert unsent >= n, "the batch must still be marked unsent after the crash"
    # The broker already holds the batch: identity applies it once...
    await eventually(lambda: _is(applied(stack, run), (n, n)), 60, "first delivery applied")
    duplicates_before = await metric(stack, "identity", "gpuaas_events_duplicate_total")
    # ...and the restarted relay publishes it again, which the inbox swallows.
    await asyncio.to_thread(stack.start_service, "allocations")
    await eventually(
        lambda: _is(stack.fetchval("allocations", "SELECT count(*) FROM outbox WHERE sent_at IS NULL"), 0),
        60,
        "re-published and marked",
    )

    async def deduped() -> bool:
        return await metric(stack, "identity", "gpuaas_events_duplicate_total") >= duplicates_before + n

    await eventually(deduped, 60, "the second copy reaching identity's inbox")
    assert await applied(stack, run) == (n, n)
    await no_dead_letters(stack)


async def test_d_broker_restart_then_replay(stack: Stack) -> None:
    if stack.external_broker:
        pytest.skip("an external broker keeps its log; broker-loss replay is an embedded-broker scenario")
    if stack.kafka is not None:
        await broker_stop_start_keeps_log(stack)
        return
    run = uuid.uuid4().hex[:8]
    n, m = 400, 150
    await commit_through_outbox(stack, run, n)
    await eventually(lambda: _is(applied(stack, run), (n, n)), 60, "events before the restart")
    # Tansu restarts empty: topics, offsets and groups are gone. The stack restarts the services and
    # replays every outbox row published to the lost broker.
    await asyncio.to_thread(stack.restart_broker)
    await eventually(
        lambda: _is(stack.fetchval("allocations", "SELECT count(*) FROM outbox WHERE sent_at IS NULL"), 0),
        120,
        "the replayed range re-published",
    )

    async def replay_deduped() -> bool:
        return await metric(stack, "identity", "gpuaas_events_duplicate_total") >= n

    await eventually(replay_deduped, 120, "replayed events reaching identity's inbox")
    await commit_through_outbox(stack, run, m, first=n)  # new events after the restart
    await eventually(lambda: _is(applied(stack, run), (n + m, n + m)), 120, "new events applied")
    await drained(stack, run)
    assert await applied(stack, run) == (n + m, n + m)
    await no_dead_letters(stack)


async def broker_stop_start_keeps_log(stack: Stack) -> None:
    """(d) on Apache Kafka: the broker is stopped while events flow and started again with its log. The
    services are not restarted and nothing is replayed: what was published before the stop is still
    there, what was committed meanwhile waits in the outbox; each is applied exactly once."""
    run = uuid.uuid4().hex[:8]
    n, m = 2000, 300
    pids = {name: stack.pid(name) for name in ("allocations", "identity")}
    await commit_through_outbox(stack, run, n)

    async def partly() -> int:
        rows, _ = await applied(stack, run)
        return rows

    await eventually(partly, 60, "the first applied batch", interval_s=0.01)
    await asyncio.to_thread(stack.stop_broker)
    await commit_through_outbox(stack, run, m, first=n)  # committed while the broker is down
    failures = await metric(stack, "allocations", "gpuaas_relay_restarts_total")

    async def relay_failed() -> bool:  # the relay tried to publish them and the broker was not there
        return await metric(stack, "allocations", "gpuaas_relay_restarts_total") > failures

    await eventually(relay_failed, 120, "the relay failing to publish while the broker is down")
    assert await stack.fetchval("allocations", "SELECT count(*) FROM outbox WHERE sent_at IS NULL") >= m
    await asyncio.to_thread(stack.start_broker)
    await eventually(lambda: _is(applied(stack, run), (n + m, n + m)), 180, "every event applied after the restart")
    await drained(stack, run)
    assert await applied(stack, run) == (n + m, n + m)
    assert {name: stack.pid(name) for name in pids} == pids, "the services rode out the broker restart"
    await no_dead_letters(stack)


async def no_dead_letters(stack: Stack) -> None:
    assert await stack.fetchval("identity", "SELECT count(*) FROM dead_letters WHERE status = 'parked'") == 0


async def _is(value_coro, expected) -> bool:
    return (await value_coro) == expected


async def _not(value_coro) -> bool:
    return not await value_coro
