"""The allocations service's business metrics on /metrics (issue 16), on a real app with a real agent:
GPUs used/free/unavailable per host class, hosts and allocations by status, placement refusals by reason,
the create→active histogram and heartbeat losses; per capacity queue, held GPUs against the guarantee."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuaas.kit.testing import wait_for

from .conftest import World
from .test_capacity_and_failures import register_without_agent

pytestmark = pytest.mark.integration


async def scrape(w: World) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    async with httpx.AsyncClient(base_url=w.url, timeout=30) as c:
        body = (await c.get("/metrics")).text
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if k != "service")): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.labels.get("service") == "allocations"
    }


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def test_capacity_allocations_refusals_activation_and_heartbeat_loss(world: World) -> None:
    w = world
    async with w.client("op") as op:
        r = await op.post("/hosts", json={"name": "m-1", "host_class": "h100-pool"})
        assert r.status_code == 201, r.text
        host = r.json()
    agent = await w.start_agent(host["node_token"], "m-1", "4xH100-80GB")
    async with w.client("op") as op:

        async def ready() -> bool:
            return (await op.get(f"/hosts/{host['host_id']}")).json()["status"] == "ready"

        await wait_for(ready, 30, "host ready")
    before = await scrape(w)
    assert value(before, "gpuaas_gpus", host_class="h100-pool", state="free") == 4.0
    assert value(before, "gpuaas_gpus", host_class="h100-pool", state="used") == 0.0
    assert value(before, "gpuaas_hosts", host_class="h100-pool", status="ready") == 1.0
    assert value(before, "gpuaas_allocation_activation_seconds_count") == 0.0

    aid = (await w.create("owner", gpu_count=3)).json()["allocation_id"]
    await w.wait_status("owner", aid, "active")
    r = await w.create("owner", gpu_count=2, queue=False)  # one GPU left
    assert r.status_code == 409 and r.json()["code"] == "insufficient_capacity", r.text
    r = await w.create("owner", gpu_model="B200-192GB")
    assert r.status_code == 422 and r.json()["code"] == "unknown_gpu_model", r.text

    after = await scrape(w)
    assert value(after, "gpuaas_gpus", host_class="h100-pool", state="used") == 3.0
    assert value(after, "gpuaas_gpus", host_class="h100-pool", state="free") == 1.0
    assert value(after, "gpuaas_allocations", status="active") == 1.0
    assert value(after, "gpuaas_allocations", status="released") == 0.0
    assert value(after, "gpuaas_placement_refusals_total", reason="insufficient_capacity") == 1.0
    assert value(after, "gpuaas_placement_refusals_total", reason="unknown_gpu_model") == 1.0
    assert value(after, "gpuaas_allocation_activation_seconds_count") == 1.0
    activation = value(after, "gpuaas_allocation_activation_seconds_sum")
    assert activation is not None and 0 < activation < 30

    # the agent stops heartbeating: the host is unreachable, its idle GPU no longer free
    await w.stop_agent(agent)

    async def lost() -> dict | None:
        s = await scrape(w)
        return s if value(s, "gpuaas_hosts", host_class="h100-pool", status="unreachable") == 1.0 else None

    gone = await wait_for(lost, 20, "host unreachable in the metrics")
    assert value(gone, "gpuaas_host_heartbeat_losses_total") == 1.0
    assert value(gone, "gpuaas_gpus", host_class="h100-pool", state="free") == 0.0
    assert value(gone, "gpuaas_gpus", host_class="h100-pool", state="unavailable") == 1.0
    assert value(gone, "gpuaas_gpus", host_class="h100-pool", state="used") == 3.0
    assert value(gone, "gpuaas_hosts", host_class="h100-pool", status="ready") is None


async def test_a_waiting_queue_below_its_guarantee_until_admitted(world: World) -> None:
    w = world
    model = "H100-80GB"
    host = await w.enrol("q-2")
    await register_without_agent(w, host["node_token"], 2)  # agent-less: an admitted request stays provisioning
    async with w.client("op") as op:
        assert (await op.post(f"/hosts/{host['host_id']}/cordon", json={"reason": "fill the queue"})).status_code == 200
        for tenant, guarantee in (("t1", 2), ("t2", 1)):
            r = await op.put(f"/tenants/{w.ids[tenant]}/queues/{model}", json={"guarantee": guarantee})
            assert r.status_code == 200, r.text
    async with w.client("tadmin") as c:
        r = await c.put(f"/projects/{w.ids['p1']}/queues/{model}", json={"guarantee": 2})
        assert r.status_code == 200, r.text
    waiting = (await w.create("owner", "p1")).json()
    assert waiting["status"] == "queued", waiting
    t1 = {"gpu_model": model, "scope": "tenant", "queue": str(w.ids["t1"])}
    p1 = {"gpu_model": model, "scope": "project", "queue": str(w.ids["p1"])}
    t2 = {"gpu_model": model, "scope": "tenant", "queue": str(w.ids["t2"])}

    before = await scrape(w)
    for q in (t1, p1):
        assert value(before, "gpuaas_capacity_queue_guarantee_gpus", **q) == 2.0
        assert value(before, "gpuaas_capacity_queue_held_gpus", **q) == 0.0
        assert value(before, "gpuaas_capacity_queue_waiting_requests", **q) == 1.0
        assert value(before, "gpuaas_capacity_queue_below_guarantee", **q) == 1.0
    # below its guarantee but asking for nothing: not below
    assert value(before, "gpuaas_capacity_queue_guarantee_gpus", **t2) == 1.0
    assert value(before, "gpuaas_capacity_queue_waiting_requests", **t2) == 0.0
    assert value(before, "gpuaas_capacity_queue_below_guarantee", **t2) == 0.0
    # only queues with settings: the project without a row has no series
    px = {"gpu_model": model, "scope": "project", "queue": str(w.ids["px"])}
    assert value(before, "gpuaas_capacity_queue_below_guarantee", **px) is None

    async with w.client("op") as op:
        assert (await op.post(f"/hosts/{host['host_id']}/uncordon")).status_code == 200
    await w.wait_status("owner", waiting["allocation_id"], "provisioning", timeout_s=15)
    after = await scrape(w)
    for q in (t1, p1):
        assert value(after, "gpuaas_capacity_queue_held_gpus", **q) == 1.0
        assert value(after, "gpuaas_capacity_queue_waiting_requests", **q) == 0.0
        assert value(after, "gpuaas_capacity_queue_below_guarantee", **q) == 0.0
    assert value(after, "gpuaas_capacity_queue_held_gpus", **t2) == 0.0
