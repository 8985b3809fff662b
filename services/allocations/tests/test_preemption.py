"""Preemption with notice (issue 29 item 4) on the real service and a real node agent (process driver).

Tenant t2 borrows the whole 2-GPU host while t1, guaranteed 2 GPUs, is idle; then t1 asks for 2. After the
minimum runtime (never before it), both of t2's allocations get the notice: a timeline entry, an
`allocation.preemption_scheduled` event with the deadline, the reason and the request they are freed for, the
notice file in the workspace and a message on their open SSH sessions, at least grace - 5 s before the stop.
At the deadline they stop (SIGTERM, then SIGKILL): the `release` one is released, the `requeue` one is released
and a new request with its spec waits with its original age. t1's request holds the freed GPUs within
grace + 30 s, and each victim's usage ends once, at the stop (one release request, one billing stop).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncssh
import pytest
from sqlalchemy import text

from gpuaas.kit.testing import wait_for

from .conftest import World, ssh_key

pytestmark = pytest.mark.integration

MODEL = "H100-80GB"
GRACE_S = 6.0
MIN_RUNTIME_S = 4.0
SETTINGS = {
    "preemption_grace_s": GRACE_S,
    "preemption_min_runtime_s": MIN_RUNTIME_S,
    "preemption_stop_timeout_s": 2.0,
    "admission_resync_s": 0.5,
}


async def _rows(w: World, sql: str, **params: object) -> list[Any]:
    async with w.kit.sessions() as s:
        return list((await s.execute(text(sql), params)).all())


async def _events(w: World, aggregate_id: str) -> list[tuple[str, dict[str, Any]]]:
    rows = await _rows(
        w,
        "SELECT event_type, convert_from(payload, 'UTF8')::jsonb -> 'data' FROM outbox "
        "WHERE aggregate_id = :a ORDER BY seq",
        a=aggregate_id,
    )
    return [(r[0], dict(r[1])) for r in rows]


@dataclass
class Watched:
    """An open SSH session on a victim that waits for the notice file and keeps what it saw, and when."""

    conn: asyncssh.SSHClientConnection
    proc: asyncssh.SSHClientProcess[str]
    notice: dict[str, Any] | None = None
    file_seen_at: float | None = None
    message: str = ""
    message_seen_at: float | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def watch(self) -> None:
        async def out() -> None:
            line = await self.proc.stdout.readline()
            if line.strip():
                self.notice, self.file_seen_at = json.loads(line), time.time()

        async def err() -> None:
            while line := await self.proc.stderr.readline():
                if "preempted" in line and self.message_seen_at is None:
                    self.message, self.message_seen_at = line.strip(), time.time()

        self.tasks = [asyncio.create_task(out()), asyncio.create_task(err())]


async def _watch(alloc: dict[str, Any], key: asyncssh.SSHKey) -> Watched:
    ep = alloc["ssh_endpoint"]
    conn = await asyncssh.connect(
        ep["host"],
        ep["port"],
        username=ep["username"],
        client_keys=[key],
        known_hosts=None,
        agent_path=None,
        config=None,
    )
    # What a job that honours the notice does: wait for the file, read it, go on working until stopped.
    proc = await conn.create_process(
        "while [ ! -f ~/.gpuaas-preemption ]; do sleep 0.05; done; cat ~/.gpuaas-preemption; sleep 600"
    )
    watched = Watched(conn, proc)
    watched.watch()
    return watched


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


@pytest.mark.parametrize("world", [SETTINGS], indirect=True)
async def test_a_guaranteed_queue_reclaims_its_gpus_with_notice(world: World) -> None:
    w = world
    t1, p1 = w.ids["t1"], w.ids["p1"]
    await w.host_with_agent("gpu-1", f"2x{MODEL}")
    async with w.client("op") as op, w.client("tadmin") as tadmin:
        assert (await op.put(f"/tenants/{t1}/queues/{MODEL}", json={"guarantee": 2})).status_code == 200
        assert (await tadmin.put(f"/projects/{p1}/queues/{MODEL}", json={"guarantee": 2})).status_code == 200
    key, public = ssh_key()
    async with w.client("stranger") as c:
        assert (await c.post("/ssh-keys", json={"name": "k", "public_key": public})).status_code == 201
    victims: dict[str, dict[str, Any]] = {}
    for choice in ("release", "requeue"):
        r = await w.create("stranger", "px", on_preemption=choice)
        assert r.status_code == 201 and r.json()["status"] == "provisioning", r.text
        victims[choice] = await w.wait_status("stranger", r.json()["allocation_id"], "active")

    async def sessions() -> dict[str, Watched] | None:
        try:
            return {choice: await _watch(a, key) for choice, a in victims.items()}
        except asyncssh.PermissionDenied:
            return None  # the key's sync has not reached the agent yet

    watched: dict[str, Watched] = await wait_for(sessions, 20, "SSH sessions on the victims")
    asked = await w.create("owner", "p1", gpu_count=2)
    assert asked.status_code == 201 and asked.json()["status"] == "queued", asked.text
    request = asked.json()["allocation_id"]
    asked_at = time.time()

    async def released() -> bool:
        rows = await _rows(
            w,
            "SELECT count(*) FROM allocations WHERE allocation_id = ANY(CAST(:ids AS uuid[])) AND status = 'released'",
            ids=[a["allocation_id"] for a in victims.values()],
        )
        return rows[0][0] == 2

    async def estimated() -> str | None:  # while it waits for its victims, it says when it should start
        async with w.client("owner") as c:
            body = (await c.get(f"/allocations/{request}")).json()
        return body["estimated_start_at"] if body["status"] == "queued" else "admitted before it was seen"

    estimate = await wait_for(estimated, GRACE_S + MIN_RUNTIME_S + 20, "an estimated start once victims are noticed")
    await wait_for(released, GRACE_S + MIN_RUNTIME_S + 30, "both victims stopped and released")
    got = await w.wait_status("owner", request, "provisioning", "active", timeout_s=30)
    held_at = time.time()
    assert len(got["gpu_indices"]) == 2
    assert got["estimated_start_at"] is None  # shown only while it waits
    deadlines = []

    for choice, alloc in victims.items():
        aid = alloc["allocation_id"]
        events = await _events(w, aid)
        types = [t for t, _ in events]
        scheduled = [d for t, d in events if t == "allocation.preemption_scheduled"]
        assert len(scheduled) == 1, types
        notice = scheduled[0]["preemption"]
        assert notice["for_allocation_id"] == request and notice["reason"] == "reclaim_guarantee"
        assert notice["on_preemption"] == choice
        deadline, scheduled_at = _ts(notice["deadline"]), _ts(notice["scheduled_at"])
        deadlines.append(deadline)
        assert abs(deadline - scheduled_at - GRACE_S) < 0.01
        # Never before the minimum runtime.
        assert scheduled_at - _ts(alloc["activated_at"]) >= MIN_RUNTIME_S, (scheduled_at, alloc["activated_at"])
        # Usage ends once, at the stop: one release request, one release, one billing stop at or after the deadline.
        assert types.count("allocation.release_requested") == 1 and types.count("allocation.released") == 1, types
        stops = {d["billing_stopped_at"] for _, d in events if d.get("billing_stopped_at")}
        assert len(stops) == 1, stops
        stopped_at = _ts(stops.pop())
        assert stopped_at >= deadline
        # The notice: file and SSH message, at least grace - 5 s before the stop.
        seen = watched[choice]
        assert seen.notice is not None and _ts(seen.notice["deadline"]) == deadline, seen.notice
        assert seen.notice["reason"] == "reclaim_guarantee" and seen.notice["on_preemption"] == choice
        assert seen.file_seen_at is not None and stopped_at - seen.file_seen_at >= GRACE_S - 5
        assert seen.message_seen_at is not None and stopped_at - seen.message_seen_at >= GRACE_S - 5, seen.message
        assert "stops at" in seen.message
        async with w.client("stranger") as c:
            timeline = (await c.get(f"/allocations/{aid}/timeline")).json()
        phases = [(e["phase"], e["status"]) for e in timeline]
        assert ("preemption", "started") in phases and ("preemption", "succeeded") in phases, phases
        assert any(e["phase"] == "preemption.notice" and "1 SSH session(s) told" in e["message"] for e in timeline)
        assert any(e["phase"] == "release.stop" and "SIGTERM" in e["message"] for e in timeline), timeline
        print(
            f"\n{choice}: notice file {stopped_at - seen.file_seen_at:.1f}s and SSH message "
            f"{stopped_at - seen.message_seen_at:.1f}s before the stop (grace {GRACE_S:.0f}s); "
            f"stopped {stopped_at - deadline:.2f}s after the deadline"
        )
        for t in seen.tasks:
            t.cancel()
        seen.conn.close()

    # Its estimated start was the latest victim deadline plus the stop timeout (SIGKILL at the latest).
    assert abs(_ts(estimate) - (max(deadlines) + SETTINGS["preemption_stop_timeout_s"])) < 0.01, (estimate, deadlines)
    assert held_at <= _ts(estimate) + 10  # and it held (a little after, with the release reports in between)
    # The freed GPUs went to the request they were freed for, within grace + 30 s.
    print(f"request -> holds the GPUs: {held_at - asked_at:.1f}s (min_runtime {MIN_RUNTIME_S:.0f}s + grace)")
    assert held_at - asked_at <= MIN_RUNTIME_S + GRACE_S + 30
    # `requeue`: a new request with the victim's spec waits with its original age; `release`: nothing more.
    requeued = await _rows(
        w,
        "SELECT allocation_id, status, enqueued_at, project_id, gpu_count FROM allocations WHERE requeued_from = :v",
        v=victims["requeue"]["allocation_id"],
    )
    assert len(requeued) == 1 and requeued[0].status == "queued", requeued
    assert requeued[0].enqueued_at.timestamp() == _ts(victims["requeue"]["requested_at"])
    assert (requeued[0].project_id, requeued[0].gpu_count) == (w.ids["px"], 1)
    none = await _rows(
        w, "SELECT count(*) FROM allocations WHERE requeued_from = :v", v=victims["release"]["allocation_id"]
    )
    assert none[0][0] == 0


@pytest.mark.parametrize("world", [{**SETTINGS, "preemption_grace_s": 3.0}], indirect=True)
async def test_a_preemption_is_called_off_when_its_request_no_longer_waits(world: World) -> None:
    w = world
    t1, p1 = w.ids["t1"], w.ids["p1"]
    await w.host_with_agent("gpu-1", f"1x{MODEL}")
    async with w.client("op") as op, w.client("tadmin") as tadmin:
        assert (await op.put(f"/tenants/{t1}/queues/{MODEL}", json={"guarantee": 1})).status_code == 200
        assert (await tadmin.put(f"/projects/{p1}/queues/{MODEL}", json={"guarantee": 1})).status_code == 200
    victim = (await w.create("stranger", "px")).json()
    await w.wait_status("stranger", victim["allocation_id"], "active")
    request = (await w.create("owner", "p1")).json()
    assert request["status"] == "queued"

    async def scheduled() -> bool:
        rows = await _rows(
            w, "SELECT preempt_deadline FROM allocations WHERE allocation_id = :a", a=victim["allocation_id"]
        )
        return rows[0][0] is not None

    await wait_for(scheduled, MIN_RUNTIME_S + 20, "the preemption scheduled")
    async with w.client("owner") as c:
        assert (await c.post(f"/allocations/{request['allocation_id']}/release")).status_code == 202

    async with w.client("stranger") as c:

        async def called_off() -> list[dict[str, Any]] | None:
            timeline = (await c.get(f"/allocations/{victim['allocation_id']}/timeline")).json()
            return timeline if any("preemption called off" in e["message"] for e in timeline) else None

        await wait_for(called_off, 20, "the preemption called off at its deadline")
    kept = await w.wait_status("stranger", victim["allocation_id"], "active")
    assert kept["release_requested_at"] is None and kept["preemption"] is None
    events = await _events(w, victim["allocation_id"])
    types = [t for t, _ in events]
    assert "allocation.release_requested" not in types
    assert types.count("allocation.preemption_scheduled") == 1 and types.count("allocation.preemption_cancelled") == 1
    assert events[-1][1]["preemption"] is None
