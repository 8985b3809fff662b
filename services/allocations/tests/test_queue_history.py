"""Issue 29, item 5: each capacity queue's share over time (`GET /queue-history`, `GET /tenants/{id}/queue-history`)
and the tenant admins' queue list (`GET /tenants/{id}/queues`), read back against allocations the API placed,
queued and admitted. The history is reconstructed from the tables, so the test moves the recorded times back
(as if the requests had happened over the last hour) and reads the series at 10-minute instants."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text

from .conftest import World

pytestmark = pytest.mark.integration

MODEL = "H100-80GB"


async def _shift(w: World, aid: str, *, requested: datetime, released: datetime | None = None) -> None:
    """Move an allocation's request (and release) back in time; its admission entry too, if it waited."""
    async with w.kit.sessions() as s, s.begin():
        await s.execute(
            text(
                "UPDATE allocations SET requested_at = :r, released_at = coalesce(:x, released_at) "
                "WHERE allocation_id = :a"
            ),
            {"r": requested, "x": released, "a": aid},
        )


async def _admitted_at(w: World, aid: str, at: datetime) -> None:
    async with w.kit.sessions() as s, s.begin():
        r = await s.execute(
            text(
                "UPDATE timeline SET started_at = :t "
                "WHERE allocation_id = :a AND phase = 'queue' AND status = 'succeeded'"
            ),
            {"t": at, "a": aid},
        )
        assert r.rowcount == 1  # pyright: ignore[reportAttributeAccessIssue]


def _series(body: dict[str, Any], scope: str, scope_id: object, key: str = "held") -> list[Any]:
    (queue,) = [q for q in body["queues"] if q["scope"] == scope and q["scope_id"] == str(scope_id)]
    return [p[key] for p in queue["points"]]


async def test_share_history_counts_a_queued_request_from_its_admission(world: World) -> None:
    w = world
    t1, t2, p1, p2 = w.ids["t1"], w.ids["t2"], w.ids["p1"], w.ids["p2"]
    await w.host_with_agent("gpu-1", f"2x{MODEL}")
    first = (await w.create("owner", "p1", name="first")).json()
    await w.wait_status("owner", first["allocation_id"], "active")
    waited = (await w.create("owner", "p2", gpu_count=2, name="waited")).json()
    assert (waited["status"], waited["pending_reason"]) == ("queued", "no_capacity"), waited
    async with w.client("owner") as c:
        assert (await c.post(f"/allocations/{first['allocation_id']}/release")).status_code == 202
    await w.wait_status("owner", first["allocation_id"], "released")
    await w.wait_status("owner", waited["allocation_id"], "provisioning", "active", timeout_s=20)
    behind = (await w.create("owner", "p1", name="behind")).json()  # waits behind the 2 GPUs p2 holds
    assert behind["status"] == "queued", behind
    async with w.client("op") as c:  # a queue with settings and no allocations is listed (operators' view)
        assert (await c.put(f"/tenants/{t2}/queues/{MODEL}", json={"guarantee": 1})).status_code == 200

    # As if: `first` ran from -50 to -30 min; `waited` asked at -45 and was admitted at -30 when `first` left.
    now = datetime.now(UTC)
    m = lambda n: now - timedelta(minutes=n)  # noqa: E731
    await _shift(w, first["allocation_id"], requested=m(50), released=m(30))
    await _shift(w, waited["allocation_id"], requested=m(45))
    await _admitted_at(w, waited["allocation_id"], m(30))
    window = {"since": m(60).isoformat(), "until": now.isoformat(), "points": 7}  # -60, -50, ..., 0

    async with w.client("tadmin") as c:
        r = await c.get(f"/tenants/{t1}/queue-history", params=window)
    assert r.status_code == 200, r.text
    body = r.json()
    projects = sorted([("project", str(p1)), ("project", str(p2))], key=lambda k: k[1])
    assert [(q["scope"], q["scope_id"]) for q in body["queues"]] == [("tenant", str(t1)), *projects]
    assert _series(body, "project", p1) == [0, 1, 1, 0, 0, 0, 0]
    # Held from its admission (-30), not from its request (-45): the queued time holds nothing.
    assert _series(body, "project", p2) == [0, 0, 0, 2, 2, 2, 2]
    assert _series(body, "tenant", t1) == [0, 1, 1, 2, 2, 2, 2]
    # The interval ending at -30 (the handover): the most at once is 2 (not 1 + 2), the mean 1 (`first` alone).
    assert _series(body, "tenant", t1, "peak")[3] == 2 and _series(body, "tenant", t1, "mean")[3] == pytest.approx(1)
    # The interval ending at -40 held `first` throughout; the one ending at -50 held it only at its end.
    assert _series(body, "project", p1, "mean")[1:3] == [0, 1]
    assert _series(body, "project", p1, "peak")[1:3] == [1, 1]

    async with w.client("op") as c:
        r = await c.get("/queue-history", params={**window, "gpu_model": MODEL})
    assert r.status_code == 200, r.text
    ops = r.json()
    assert {(q["scope"], q["scope_id"]) for q in ops["queues"]} == {("tenant", str(t1)), ("tenant", str(t2))}
    assert _series(ops, "tenant", t1) == [0, 1, 1, 2, 2, 2, 2]
    assert _series(ops, "tenant", t2) == [0] * 7
    assert next(q for q in ops["queues"] if q["scope_id"] == str(t2))["guarantee"] == 1
    async with w.client("op") as c:
        assert (await c.get("/queue-history", params={**window, "gpu_model": "NOPE-1"})).json()["queues"] == []

    # The tenant admin's list of queues now: the tenant, its projects, what each holds and waits for (and why).
    async with w.client("tadmin") as c:
        r = await c.get(f"/tenants/{t1}/queues")
    assert r.status_code == 200, r.text
    queues = {(q["scope"], q["scope_id"]): q for q in r.json()}
    assert set(queues) == {("tenant", str(t1)), ("project", str(p1)), ("project", str(p2))}
    assert (queues[("tenant", str(t1))]["in_use"], queues[("tenant", str(t1))]["waiting"]) == (2, 1)
    assert queues[("project", str(p2))]["in_use"] == 2
    assert queues[("project", str(p1))]["pending_reasons"] == {"no_capacity": 1}


async def test_share_history_permissions_and_bad_windows(world: World) -> None:
    w = world
    t1 = w.ids["t1"]
    async with w.client("tadmin") as c:
        assert (await c.get(f"/tenants/{t1}/queue-history")).status_code == 200
        assert (await c.get("/queue-history")).status_code == 403  # every tenant's: operators only
    for who in ("owner", "admin", "viewer"):  # project roles: not the tenant's queues
        async with w.client(who) as c:
            assert (await c.get(f"/tenants/{t1}/queue-history")).status_code == 403, who
            assert (await c.get(f"/tenants/{t1}/queues")).status_code == 403, who
    async with w.client("stranger") as c:  # another tenant's admin: the tenant is not theirs to see
        assert (await c.get(f"/tenants/{t1}/queue-history")).status_code == 404
        assert (await c.get(f"/tenants/{t1}/queues")).status_code == 404
    async with w.client("op") as c:
        r = await c.get("/queue-history")  # the default window: 24 h to now, 25 instants
        assert r.status_code == 200, r.text
        span = datetime.fromisoformat(r.json()["until"]) - datetime.fromisoformat(r.json()["since"])
        assert span == timedelta(hours=24) and r.json()["queues"] == []

        now = datetime.now(UTC)
        bad = [
            {"since": now.isoformat(), "until": (now - timedelta(hours=1)).isoformat()},  # ends before it starts
            {"since": (now + timedelta(hours=1)).isoformat()},  # starts after now
            {"since": (now - timedelta(days=63)).isoformat(), "until": now.isoformat()},  # too long
            {"since": "2026-01-01T00:00:00"},  # no time zone
            {"until": "0001-01-01T00:00:00Z"},  # the default start would fall off the calendar
            {"since": "0001-01-01T00:00:00Z", "until": "0001-01-02T00:00:00Z"},  # over 10 years ago
        ]
        for params in bad:
            r = await c.get("/queue-history", params=params)
            assert r.status_code == 422, (params, r.text)
            assert r.headers["content-type"].startswith("application/problem+json")
            assert r.json()["code"] == "invalid_window", r.json()
        for params in ({"points": 1}, {"points": 501}, {"since": "yesterday"}):
            r = await c.get("/queue-history", params=params)
            assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json"), params
