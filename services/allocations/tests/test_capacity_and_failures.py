"""Placement under concurrency, quotas, baremetal, volumes, release_failed + retry, lost heartbeats,
agent restarts (no task lost, none run twice), drain."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from gpuaas.contracts.agent import AgentResult, TaskCompletion, TaskLease
from gpuaas.kit.testing import wait_for
from gpuaas.node_agent.agent import Agent

from .conftest import World, last_seq, ssh_key, ssh_run, task_done

pytestmark = pytest.mark.integration


async def register_without_agent(w: World, token: str, gpus: int, model: str = "H100-80GB") -> None:
    body = {
        "agent_version": "test",
        "ssh_host": "127.0.0.1",
        "ssh_port": 2222,
        "gpus": [{"index": i, "model": model, "memory_mb": 81920} for i in range(gpus)],
    }
    async with httpx.AsyncClient(base_url=w.url, headers={"Authorization": f"Bearer {token}"}) as c:
        r = await c.post("/agent/register", json=body)
        assert r.status_code == 200, r.text

    async def heartbeats() -> None:  # an agent-less host must still look alive (3 s timeout in tests)
        async with httpx.AsyncClient(base_url=w.url, headers={"Authorization": f"Bearer {token}"}) as c:
            while True:
                await c.post("/agent/heartbeat")
                await asyncio.sleep(0.5)

    w.background.append(asyncio.create_task(heartbeats()))


async def test_concurrent_creates_never_double_book(world: World) -> None:
    w = world
    for name in ("h-a", "h-b"):
        await register_without_agent(w, (await w.enrol(name))["node_token"], 4)
    results = await asyncio.gather(*[w.create("owner", gpu_count=1, queue=False) for _ in range(12)])
    codes = Counter(r.status_code for r in results)
    assert codes == {201: 8, 409: 4}, [r.json() for r in results if r.status_code != 201][:2]
    assert all(r.json()["code"] == "insufficient_capacity" for r in results if r.status_code == 409)
    placed = [(r.json()["host_id"], i) for r in results if r.status_code == 201 for i in r.json()["gpu_indices"]]
    assert len(placed) == len(set(placed)) == 8
    async with w.kit.sessions() as s:
        assert (await s.execute(text("SELECT count(*) FROM gpu_assignments"))).scalar_one() == 8


async def test_quota_and_baremetal(world: World) -> None:
    w = world
    await register_without_agent(w, (await w.enrol("big"))["node_token"], 8)
    await register_without_agent(w, (await w.enrol("small"))["node_token"], 4, "A100-80GB")
    async with w.client("tadmin") as c:
        r = await c.put(f"/projects/{w.ids['p2']}/quota", json={"max_gpus": 3})
        assert r.status_code == 200 and r.json()["max_gpus"] == 3
    async with w.client("owner") as c:
        assert (await c.put(f"/projects/{w.ids['p2']}/quota", json={"max_gpus": 99})).status_code == 403
    assert (await w.create("owner", "p2", gpu_count=2)).status_code == 201
    r = await w.create("owner", "p2", gpu_count=2, queue=False)
    assert r.status_code == 409 and r.json()["code"] == "quota_exceeded" and r.json()["quota"] == 3
    assert (await w.create("owner", "p2", gpu_count=1)).status_code == 201
    # Baremetal takes a whole host of the model, and only an empty one.
    r = await w.create("owner", shape="baremetal", gpu_model="A100-80GB", gpu_count=None)
    assert r.status_code == 201 and r.json()["gpu_count"] == 4 and r.json()["gpu_indices"] == [0, 1, 2, 3]
    r = await w.create("owner", gpu_model="A100-80GB", gpu_count=1, queue=False)
    assert r.status_code == 409 and r.json()["code"] == "insufficient_capacity"
    r = await w.create("owner", shape="baremetal", gpu_model="H100-80GB", gpu_count=None, queue=False)
    assert r.status_code == 409  # the H100 host already carries slices


async def test_volumes_persistence_and_single_writer(world: World) -> None:
    w = world
    _, agent = await w.host_with_agent("gpu-1", "8xH100-80GB")
    key, pub = ssh_key()
    async with w.client("owner") as c:
        await c.post("/ssh-keys", json={"name": "k", "public_key": pub})
        keep = (
            await c.post(f"/projects/{w.ids['p1']}/volumes", json={"name": "data", "size_gb": 10, "persist": True})
        ).json()
        scratch = (
            await c.post(
                f"/projects/{w.ids['p1']}/volumes",
                json={"name": "tmp", "size_gb": 5, "persist": False, "access_mode": "multi_attach"},
            )
        ).json()
        assert keep["after_release"].startswith("kept") and scratch["after_release"].startswith("deleted")
        r = await c.post(f"/projects/{w.ids['p1']}/volumes", json={"name": "data", "size_gb": 1})
        assert r.status_code == 409 and r.json()["code"] == "volume_name_taken"
        r = await w.create("owner", volume_ids=[keep["volume_id"], scratch["volume_id"]])
        assert r.status_code == 201, r.text
        a1 = await w.wait_status("owner", r.json()["allocation_id"], "active")
        assert "volumes kept: data" in a1["after_release"] and "volumes deleted: tmp" in a1["after_release"]
        out = await ssh_run(a1, key, "echo hello > volumes/data/f && echo x > volumes/tmp/g && cat volumes/data/f")
        assert out.stdout.strip() == "hello", out.stderr
        # A second writer is refused; multi_attach is fine.
        a2 = await w.wait_status("owner", (await w.create("owner")).json()["allocation_id"], "active")
        r = await c.post(f"/allocations/{a2['allocation_id']}/volumes", json={"volume_id": keep["volume_id"]})
        assert r.status_code == 409 and r.json()["code"] == "volume_single_writer_in_use"
        r = await c.post(f"/allocations/{a2['allocation_id']}/volumes", json={"volume_id": scratch["volume_id"]})
        assert r.status_code == 201 and len(r.json()["attachments"]) == 2
        r = await c.delete(f"/allocations/{a2['allocation_id']}/volumes/{scratch['volume_id']}")
        assert r.status_code == 200 and len(r.json()["attachments"]) == 1
        assert (await c.delete(f"/volumes/{keep['volume_id']}")).json()["code"] == "volume_attached"
        # Release: the persistent volume keeps its data, the other is deleted with its data.
        await c.post(f"/allocations/{a1['allocation_id']}/release")
        await w.wait_status("owner", a1["allocation_id"], "released")
        kept = (await c.get(f"/volumes/{keep['volume_id']}")).json()
        assert kept["status"] == "available" and kept["attachments"] == []
        assert (agent.state_dir / "volumes" / keep["volume_id"] / "f").read_text() == "hello\n"
        assert (await c.get(f"/volumes/{scratch['volume_id']}")).status_code == 404
        assert not (agent.state_dir / "volumes" / scratch["volume_id"]).exists()
        # ... and the kept volume can be attached to another allocation later.
        seen = await last_seq(c, a2["allocation_id"])
        r = await c.post(f"/allocations/{a2['allocation_id']}/volumes", json={"volume_id": keep["volume_id"]})
        assert r.status_code == 201
        await task_done(c, a2["allocation_id"], "attach_volume", seen)
        assert (await ssh_run(a2, key, "cat volumes/data/f")).stdout.strip() == "hello"


async def test_release_failed_then_retry(world: World) -> None:
    w = world
    await w.host_with_agent("gpu-1", "8xH100-80GB", inject_failures="release:1")
    aid = (await w.create("owner")).json()["allocation_id"]
    await w.wait_status("owner", aid, "active")
    async with w.client("owner") as c:
        first = (await c.post(f"/allocations/{aid}/release")).json()
        failed = await w.wait_status("owner", aid, "release_failed")
        assert "injected failure" in failed["failure_reason"]
        assert failed["billing_stopped_at"] == first["billing_stopped_at"]
        r = await c.post(f"/allocations/{aid}/release")
        assert r.status_code == 409 and r.json()["code"] == "release_failed_use_retry"
        r = await c.post(f"/allocations/{aid}/retry-release")
        assert r.status_code == 202 and r.json()["release_attempts"] == 2
        done = await w.wait_status("owner", aid, "released")
        assert done["billing_stopped_at"] == first["billing_stopped_at"] and done["failure_reason"] is None
        r = await c.post(f"/allocations/{aid}/retry-release")
        assert r.status_code == 409


async def test_heartbeat_loss_is_visible_and_recovers(world: World) -> None:
    w = world
    host, agent = await w.host_with_agent("gpu-1", "8xH100-80GB")
    aid = (await w.create("owner")).json()["allocation_id"]
    await w.wait_status("owner", aid, "active")
    await w.stop_agent(agent)
    async with w.client("owner") as c:

        async def flagged() -> dict | None:
            a = (await c.get(f"/allocations/{aid}")).json()
            return a if a.get("attention") else None

        a = await wait_for(flagged, 20, "attention on the allocation")
        assert "unreachable" in a["attention"] and a["status"] == "active"
        async with w.client("op") as op:
            assert (await op.get(f"/hosts/{host['host_id']}")).json()["status"] == "unreachable"
        await w.start_agent(host["node_token"], "gpu-1")

        async def cleared() -> bool:
            return (await c.get(f"/allocations/{aid}")).json()["attention"] is None

        await wait_for(cleared, 20, "attention cleared")


async def test_agent_restart_loses_and_repeats_nothing(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    w = world
    host, agent = await w.host_with_agent("gpu-1", "8xH100-80GB")
    key, pub = ssh_key()
    async with w.client("owner") as c:
        assert (await c.post("/ssh-keys", json={"name": "k", "public_key": pub})).status_code == 201
    await w.stop_agent(agent)
    # Queued while the agent is down: not lost.
    aid = (await w.create("owner")).json()["allocation_id"]
    # A first agent process leases the task, executes and journals it, then dies before reporting. It
    # served SSH on the port the agent remembers in its state directory (what its journaled result says).
    crashed = Agent(agent.s)
    async with httpx.AsyncClient(base_url=w.url, headers={"Authorization": f"Bearer {host['node_token']}"}) as c:
        tasks = (await c.get("/agent/tasks", params={"wait_s": 2})).json()
    assert [t["kind"] for t in tasks] == ["provision"]
    crashed.ssh_port = agent.ssh_port
    lease = TaskLease.model_validate(tasks[0])
    outcome = await crashed.execute(lease)
    # Journaled without the result's `kind`, as an agent before the typed protocol did: the replay still applies.
    result = outcome.model_dump(mode="json", exclude_unset=True)
    crashed.journal.put(str(lease.task_id), TaskCompletion(ok=True, message="done", result=result))
    await crashed.client.aclose()
    executed: list[str] = []
    original = Agent.execute

    async def counting(self: Agent, lease: TaskLease) -> AgentResult:
        executed.append(lease.kind)
        return await original(self, lease)

    monkeypatch.setattr(Agent, "execute", counting)
    restarted = await w.start_agent(host["node_token"], "gpu-1")
    alloc = await w.wait_status("owner", aid, "active")
    assert executed == []  # replayed from the journal, not run again
    # The endpoint the replayed outcome restored is the one the restarted agent serves, and it lets the
    # owner into the workspace the first process provisioned.
    assert restarted.ssh_port == agent.ssh_port
    assert alloc["ssh_endpoint"] == {
        "host": restarted.s.ssh_bind,
        "port": restarted.ssh_port,
        "username": alloc["ssh_endpoint"]["username"],
    }
    out = await ssh_run(alloc, key, "echo $GPUAAS_ALLOCATION_ID; pwd")
    assert out.exit_status == 0, out.stderr
    marker, cwd = out.stdout.split()
    assert marker == aid and Path(cwd).resolve() == (restarted.state_dir / "allocations" / aid / "home").resolve()
    async with w.kit.sessions() as s:
        row = (
            await s.execute(text("SELECT status, attempts FROM agent_tasks WHERE allocation_id = :a"), {"a": aid})
        ).one()
    assert row.status == "succeeded" and row.attempts == 2


async def test_drain_releases_and_cordon_blocks_placement(world: World) -> None:
    w = world
    host, _ = await w.host_with_agent("gpu-1", "8xH100-80GB")
    aid = (await w.create("owner")).json()["allocation_id"]
    await w.wait_status("owner", aid, "active")
    async with w.client("op") as op:
        r = await op.post(f"/hosts/{host['host_id']}/cordon", json={"reason": "maintenance"})
        assert r.status_code == 200 and r.json()["status"] == "cordoned"
        r = await w.create("owner", queue=False)
        assert r.status_code == 409 and r.json()["code"] == "insufficient_capacity"
        r = await op.post(f"/hosts/{host['host_id']}/drain", json={"reason": "hardware swap"})
        assert r.status_code == 200
        await w.wait_status("owner", aid, "released")
        assert (await op.post(f"/hosts/{host['host_id']}/uncordon")).json()["status"] == "ready"
    async with w.client("owner") as c:
        timeline = (await c.get(f"/allocations/{aid}/timeline")).json()
        assert any("hardware swap" in e["message"] for e in timeline)
        assert (await c.post(f"/hosts/{host['host_id']}/cordon", json={"reason": "x"})).status_code == 403
    assert (await w.create("owner")).status_code == 201
