"""Issue 21: the operators' capacity view (`GET /capacity`): used/free GPUs per host class over time and
which allocation holds each GPU of each host, read back against the placements the API made."""

from __future__ import annotations

import pytest

from .conftest import World
from .test_capacity_and_failures import register_without_agent

pytestmark = pytest.mark.integration


async def test_capacity_per_class_and_occupancy(world: World) -> None:
    w = world
    for name, cls, gpus in (("cap-a", "train", 4), ("cap-b", "train", 4), ("cap-c", "infer", 2)):
        async with w.client("op") as c:
            r = await c.post("/hosts", json={"name": name, "host_class": cls})
            assert r.status_code == 201, r.text
        await register_without_agent(w, r.json()["node_token"], gpus)
    placed = []
    for cls, n in (("train", 3), ("train", 2), ("infer", 1)):
        r = await w.create("owner", gpu_count=n, host_class=cls, name=f"cap-{cls}-{n}")
        assert r.status_code == 201, r.text
        placed.append(r.json())

    async with w.client("op") as c:
        r = await c.get("/capacity", params={"hours": 2, "points": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    classes = {k["host_class"]: k for k in body["classes"]}
    assert (classes["train"]["total_gpus"], classes["train"]["used_gpus"], classes["train"]["hosts"]) == (8, 5, 2)
    assert (classes["infer"]["total_gpus"], classes["infer"]["used_gpus"]) == (2, 1)
    # The series: 5 instants, the last one now (matching the assignments), none before the hosts existed.
    train = classes["train"]["points"]
    assert len(train) == 5 and train[-1] == {**train[-1], "total": 8, "used": 5, "free": 3, "peak_used": 5}
    assert all(p["peak_used"] >= p["used"] and p["mean_used"] <= p["peak_used"] for p in train)
    assert train[0]["total"] == 0 and train[0]["used"] == 0
    # Occupancy: exactly the GPUs the placements returned, each with its allocation.
    held = {(h["name"], g["index"]): g["allocation_id"] for h in body["hosts"] for g in h["gpus"] if g["allocation_id"]}
    by_host = {h["host_id"]: h["name"] for h in body["hosts"]}
    expected = {(by_host[a["host_id"]], i): a["allocation_id"] for a in placed for i in a["gpu_indices"]}
    assert held == expected and len(held) == 6
    names = {g["allocation_name"] for h in body["hosts"] for g in h["gpus"] if g["allocation_id"]}
    assert names == {"cap-train-3", "cap-train-2", "cap-infer-1"}

    # Operators only.
    for who in ("tadmin", "owner"):
        async with w.client(who) as c:
            assert (await c.get("/capacity")).status_code == 403, who
    async with w.client("op") as c:
        assert (await c.get("/capacity", params={"points": 1})).status_code == 422


async def test_an_allocation_between_two_instants_shows_in_peak_and_mean(world: World) -> None:
    """Placed and released between the two instants of the series: used at neither, but the interval that ends
    at the last instant carries its peak and its mean."""
    w = world
    async with w.client("op") as c:
        r = await c.post("/hosts", json={"name": "burst-1", "host_class": "burst"})
        assert r.status_code == 201, r.text
    await w.start_agent(r.json()["node_token"], "burst-1", "4xH100-80GB")
    r = await w.create("owner", gpu_count=3, host_class="burst", name="burst-3")
    assert r.status_code == 201, r.text
    aid = r.json()["allocation_id"]
    await w.wait_status("owner", aid, "active")
    async with w.client("owner") as c:
        assert (await c.post(f"/allocations/{aid}/release")).status_code in (200, 202)
    await w.wait_status("owner", aid, "released")

    async with w.client("op") as c:
        r = await c.get("/capacity", params={"hours": 1, "points": 2})
    assert r.status_code == 200, r.text
    first, last = next(k for k in r.json()["classes"] if k["host_class"] == "burst")["points"]
    assert (first["used"], last["used"], last["total"]) == (0, 0, 4)
    assert last["peak_used"] == 3 and 0 < last["mean_used"] < 3
    assert first["peak_used"] == 0 and first["mean_used"] == 0
