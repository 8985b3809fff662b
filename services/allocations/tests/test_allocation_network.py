"""The allocation's project-network address: the task payload names the allocation's project (the
container driver's network key), the agent's reported address reaches the allocation view (what app
controllers give the other members), a malformed report is not taken, and a restart without a report
keeps the last one."""

from __future__ import annotations

import pytest

from .conftest import FakeAgent, World

pytestmark = pytest.mark.integration


async def test_network_address_reported_by_the_agent_is_in_the_view(world: World) -> None:
    w = world
    async with w.client("op") as c:
        r = await c.post("/hosts", json={"name": "net-1"})
        assert r.status_code == 201, r.text
        host = r.json()
    agent = FakeAgent(w.url, host["node_token"])
    try:
        assert (await agent.register(driver="process", isolates_tenants=False, ssh_port=2202)).status_code == 200
        r = await w.create("owner")
        assert r.status_code == 201, r.text
        aid = r.json()["allocation_id"]
        assert r.json()["network"] is None  # nothing reported yet
        task = await agent.task_for(aid, "provision")
        assert task["payload"]["project_id"] == str(w.ids["p1"]), task["payload"]
        assert task["payload"]["tenant_id"], task["payload"]
        net = {"name": "gpuaas-p-" + w.ids["p1"].hex, "address": "10.89.3.7", "hostname": "gpuaas-1234abcd"}
        await agent.complete(task, ssh_host="127.0.0.1", ssh_port=2202, network={**net, "scope": "planet", "x": 1})
        alloc = await w.wait_status("owner", aid, "active")
        assert alloc["network"] == {**net, "scope": "host"}, alloc["network"]

        async with w.client("owner") as c:
            assert (await c.post(f"/allocations/{aid}/restart")).status_code == 202
        await agent.complete(await agent.task_for(aid, "restart"))  # an older agent: no network in the result
        alloc = await w.wait_status("owner", aid, "active")
        assert alloc["network"] == {**net, "scope": "host"}, alloc["network"]

        async with w.client("owner") as c:
            assert (await c.post(f"/allocations/{aid}/restart")).status_code == 202
        bad = {"name": "bad name; rm -rf /", "address": "10.89.3.8"}
        await agent.complete(await agent.task_for(aid, "restart"), network=bad)
        alloc = await w.wait_status("owner", aid, "active")
        assert alloc["network"] is None, alloc["network"]  # a malformed report is not shown to controllers

        async with w.client("owner") as c:
            assert (await c.post(f"/allocations/{aid}/restart")).status_code == 202
        await agent.complete(await agent.task_for(aid, "restart"), network={**net, "address": "not-an-ip"})
        alloc = await w.wait_status("owner", aid, "active")
        assert alloc["network"] == {**net, "address": None, "scope": "host"}, alloc["network"]
    finally:
        await agent.aclose()
