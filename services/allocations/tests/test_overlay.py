"""The project overlay's address plan (issue 27 item 1): each allocation on a container host gets an address in
its project's subnet (unique, kept across a restart), its project one VNI shared by its members and different
from another project's; the provision task names the hosts (enrolled addresses) and members' names; a host's
heartbeat answer carries its segments as they are now, so a released member leaves the other hosts' peers."""

from __future__ import annotations

import hashlib
import ipaddress
import uuid
from typing import Any

import pytest
from sqlalchemy import insert

from gpuaas.allocations.models import catalog_artifacts, catalog_runtimes
from gpuaas.allocations.service import overlay

from .conftest import FakeAgent, World


def test_a_configured_pool_cuts_its_own_segments_and_refuses_what_cannot_work() -> None:
    """A second control plane on the same machine takes a disjoint pool (the devstack gives each stack one)."""
    small = overlay.OverlayPool.parse("10.211.0.0/16", 0x130000)
    assert small.segments == 256
    assert small.subnet_of(0) == ipaddress.IPv4Network("10.211.0.0/24")
    assert small.subnet_of(255) == ipaddress.IPv4Network("10.211.255.0/24")
    with pytest.raises(overlay.OverlayExhausted, match="every segment"):
        small.first_free_index(set(range(256)))
    with pytest.raises(ValueError, match="at least one /24"):
        overlay.OverlayPool.parse("10.211.0.0/25", 0x130000)
    with pytest.raises(ValueError, match="VNIs"):
        overlay.OverlayPool.parse("10.208.0.0/12", (1 << 24) - 10)
    with pytest.raises(ValueError):
        overlay.OverlayPool.parse("10.211.0.1/16", 0x130000)  # host bits set: a typo, not a pool


def test_the_plan_picks_the_lowest_free_index_and_address_and_names_members() -> None:
    pool = overlay.OverlayPool()
    assert pool.subnet_of(0) == ipaddress.IPv4Network("10.208.0.0/24")
    assert pool.subnet_of(300) == ipaddress.IPv4Network("10.209.44.0/24")
    assert pool.first_free_index({0, 1, 3}) == 2
    subnet = pool.subnet_of(0)
    assert str(overlay.first_free_address(subnet, set())) == "10.208.0.2"  # .1 is every host's gateway
    assert str(overlay.first_free_address(subnet, {"10.208.0.2", "10.208.0.4"})) == "10.208.0.3"
    with pytest.raises(overlay.OverlayExhausted):
        overlay.first_free_address(subnet, {str(a) for a in subnet.hosts()})
    with pytest.raises(overlay.OverlayExhausted):
        pool.subnet_of(pool.segments)
    project = uuid.UUID("0123456789abcdef0123456789abcdef")
    a, b, c = (uuid.UUID(int=i) for i in (1, 2, 3))
    members = [(a, "Trainer #1", "10.208.0.2"), (b, "w", "10.208.0.3"), (c, "w", "10.208.0.4")]
    assert overlay.names_of(project, members) == {
        f"{a}.p-0123456789ab": "10.208.0.2",
        f"{b}.p-0123456789ab": "10.208.0.3",
        f"{c}.p-0123456789ab": "10.208.0.4",
        "trainer-1.p-0123456789ab": "10.208.0.2",  # "w" names two members: neither gets it
    }


async def _runtime(w: World) -> str:
    """A runtime of this test's own in the catalog projection (test_runtimes.py covers how catalog events fill it)."""
    slug = f"t{uuid.uuid4().hex[:6]}-base"
    digest = "sha256:" + hashlib.sha256(slug.encode()).hexdigest()
    ref, artifact = f"127.0.0.1:5999/runtimes/{slug}@{digest}", uuid.uuid4()
    async with w.kit.sessions() as s, s.begin():
        await s.execute(
            insert(catalog_artifacts).values(artifact_id=artifact, ref=ref, digest=digest, state="active", version=1)
        )
        await s.execute(
            insert(catalog_runtimes).values(
                manifest_id=uuid.uuid4(),
                slug=slug,
                app_version="1.0.0",
                active=True,
                deprecated=False,
                artifact_ref=ref,
                artifact_id=artifact,
                revision=1,
            )
        )
    return f"{slug}@1.0.0"


async def _host(w: World, name: str, underlay: str) -> FakeAgent:
    async with w.client("op") as c:
        r = await c.post("/hosts", json={"name": name})
        assert r.status_code == 201, r.text
    agent = FakeAgent(w.url, r.json()["node_token"])
    gpus = [{"index": 0, "model": "H100-80GB", "memory_mb": 81920}]  # one GPU: each allocation on its own host
    assert (await agent.register(ssh_host=underlay, gpus=gpus)).status_code == 200
    return agent


async def _provisioned(
    w: World, agents: list[FakeAgent], project: str, runtime: str
) -> tuple[str, dict[str, Any], FakeAgent]:
    r = await w.create("owner", project=project, runtime=runtime)
    assert r.status_code == 201, r.text
    aid = r.json()["allocation_id"]
    for agent in agents:
        leased = await agent.tasks(0.5)
        agent.leased.extend(leased)
        task = next((t for t in agent.leased if t["allocation_id"] == aid and t["kind"] == "provision"), None)
        if task is not None:
            agent.leased.remove(task)
            spec = task["payload"]["overlay"]
            net = {"name": "gpuaas-p-" + w.ids[project].hex, "address": spec["address"], "hostname": "h"}
            await agent.complete(task, ssh_host="127.0.0.1", ssh_port=2222, network=net)
            await w.wait_status("owner", aid, "active")
            return aid, spec, agent
    raise AssertionError(f"no provision task for {aid}")


@pytest.mark.integration
async def test_members_get_stable_unique_addresses_peers_and_names(world: World) -> None:
    w = world
    runtime = await _runtime(w)
    agents = [await _host(w, f"ovl-{uuid.uuid4().hex[:6]}", f"198.18.9.{i}") for i in (1, 2, 3)]
    try:
        a1, s1, h1 = await _provisioned(w, agents, "p1", runtime)
        a2, s2, h2 = await _provisioned(w, agents, "p1", runtime)
        b1, s3, _ = await _provisioned(w, agents, "p2", runtime)
        assert h1 is not h2
        assert (s1["vni"], s1["subnet"]) == (s2["vni"], s2["subnet"]) and s1["address"] != s2["address"]
        assert s3["vni"] != s1["vni"] and s3["subnet"] != s1["subnet"]  # another project: another segment
        for spec in (s1, s2):
            assert ipaddress.IPv4Address(spec["address"]) in ipaddress.IPv4Network(spec["subnet"])
        # The second member's task names both hosts (enrolled addresses) with their members, and both names.
        peers = {p["underlay"]: p["addresses"] for p in s2["peers"]}
        assert sorted(peers.values()) == sorted([[s1["address"]], [s2["address"]]]) and len(peers) == 2
        assert s2["underlay"] in peers
        domain = "p-" + w.ids["p1"].hex[:12]
        assert s2["names"][f"{a1}.{domain}"] == s1["address"]
        assert s2["names"][f"{a2}.{domain}"] == s2["address"]

        async with w.client("owner") as c:
            view = (await c.get(f"/allocations/{a1}")).json()["network"]
            assert view["address"] == s1["address"] and view["scope"] == "project", view
            assert (await c.post(f"/allocations/{a1}/restart")).status_code == 202
        restart = await h1.task_for(a1, "restart")
        assert restart["payload"]["overlay"]["address"] == s1["address"]  # kept across a restart
        await h1.complete(restart)  # an older agent's report (no network): the assignment stays
        await w.wait_status("owner", a1, "active")

        # The heartbeat's answer: h1's segments as they are now (p1 with both hosts).
        r = await h1.client.post("/agent/heartbeat")
        segments = {s["project_id"]: s for s in r.json()["overlays"]}
        assert set(segments) == {str(w.ids["p1"])} and len(segments[str(w.ids["p1"])]["peers"]) == 2

        async with w.client("owner") as c:
            assert (await c.post(f"/allocations/{a2}/release")).status_code == 202
        await h2.complete(await h2.task_for(a2, "release"), verified=True)
        await w.wait_status("owner", a2, "released")
        r = await h1.client.post("/agent/heartbeat")
        (segment,) = r.json()["overlays"]
        assert [p["addresses"] for p in segment["peers"]] == [[s1["address"]]]  # a2 left the other hosts' peers
        assert f"{a2}.{domain}" not in segment["names"] and segment["address"] is None
        assert b1 not in str(segment)  # p2's member is on a host of its own, in no p1 segment
    finally:
        for agent in agents:
            await agent.aclose()
