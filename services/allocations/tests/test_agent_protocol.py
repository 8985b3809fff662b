"""The agent protocol across versions, against the real service: an agent one version behind (the shape the
code spoke before `gpuaas.contracts.agent`, kept in libs/contracts/tests/samples/protocol-v0.json) registers,
reads its tasks by the keys it knows and reports results without the new fields; task rows the landed code
queued (payloads without `kind`) are still handed out; a row this version cannot read is failed, never handed
out, and does not block the host's queue."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from sqlalchemy import insert, select

from gpuaas.allocations.models import agent_tasks
from gpuaas.contracts import new_event_id

from .conftest import FakeAgent, World

pytestmark = pytest.mark.integration

SAMPLES = json.loads(
    (Path(__file__).resolve().parents[3] / "libs/contracts/tests/samples/protocol-v0.json").read_text()
)
# Every payload key the agent before the typed protocol read (agent.py, workspace.py of commit 1eeb553).
OLD_AGENT_READS = {
    "provision": {
        "allocation_id",
        "username",
        "gpu_indices",
        "authorized_keys",
        "volumes",
        "runtime",
        "limits",
        "project_id",
    },
    "release": {"allocation_id", "username", "volumes"},
    "sync_ssh_keys": {"allocation_id", "authorized_keys"},
}


async def test_an_agent_one_version_behind_works_with_this_control_plane(world: World) -> None:
    w = world
    host = await w.enrol("old-agent")
    agent = FakeAgent(w.url, host["node_token"])
    try:
        # the old agent's body (its reconcile report included), on a process host: no runtime image to offer
        old = {k: v for k, v in SAMPLES["registration"].items() if k not in ("ssh_host_key", "gpus")}
        r = await agent.register(**{**old, "driver": "process", "isolates_tenants": False})
        assert r.status_code == 200, r.text
        assert {"host_id", "name", "status", "heartbeat_interval_s", "ssh_ca_public_key"} <= set(r.json())

        aid = (await w.create("owner")).json()["allocation_id"]
        task = await agent.task_for(aid, "provision")
        assert OLD_AGENT_READS["provision"] <= set(task["payload"]), task["payload"]
        assert task["payload"]["allocation_id"] == aid and isinstance(task["payload"]["gpu_indices"], list)
        # the old agent's result: no `kind`, the fields of its time
        result = {**SAMPLES["results"]["provision"], "username": task["payload"]["username"]}
        await agent.complete(task, message="provision done in 1.20s", **result)
        alloc = await w.wait_status("owner", aid, "active")
        assert alloc["network"] == SAMPLES["results"]["provision"]["network"], alloc["network"]

        async with w.client("owner") as c:
            assert (await c.post(f"/allocations/{aid}/release")).status_code == 202
        task = await agent.task_for(aid, "release")
        assert OLD_AGENT_READS["release"] <= set(task["payload"]), task["payload"]
        await agent.complete(task, **SAMPLES["results"]["release"])
        released = await w.wait_status("owner", aid, "released")
        assert released["release_evidence"] == SAMPLES["results"]["release"]["evidence"]
    finally:
        await agent.aclose()


async def test_rows_queued_by_the_landed_code_are_handed_out_and_unreadable_rows_fail(world: World) -> None:
    w = world
    host = await w.enrol("queue-host")
    agent = FakeAgent(w.url, host["node_token"])
    try:
        assert (await agent.register(driver="process", isolates_tenants=False)).status_code == 200
        aid = (await w.create("owner")).json()["allocation_id"]
        provision = await agent.task_for(aid, "provision")
        await agent.complete(provision, ssh_host="127.0.0.1", ssh_port=2222)
        await w.wait_status("owner", aid, "active")

        landed, unreadable = new_event_id(), new_event_id()
        async with w.kit.sessions() as s, s.begin():
            # a newer control plane's kind, queued first: it must not block the one after it
            await s.execute(
                insert(agent_tasks).values(
                    task_id=unreadable,
                    host_id=uuid.UUID(host["host_id"]),
                    allocation_id=uuid.UUID(aid),
                    kind="migrate",
                    payload={"allocation_id": aid, "to": "elsewhere"},
                    status="pending",
                )
            )
            # what `_enqueue` of the landed code wrote: a plain dict, no `kind`, ids as text
            await s.execute(
                insert(agent_tasks).values(
                    task_id=landed,
                    host_id=uuid.UUID(host["host_id"]),
                    allocation_id=uuid.UUID(aid),
                    kind="sync_ssh_keys",
                    payload={**SAMPLES["tasks"]["sync_ssh_keys"], "allocation_id": aid},
                    status="pending",
                )
            )
        task = await agent.task_for(aid, "sync_ssh_keys")
        assert task["task_id"] == str(landed)
        assert task["payload"] == {**SAMPLES["tasks"]["sync_ssh_keys"], "allocation_id": aid, "kind": "sync_ssh_keys"}
        await agent.complete(task, keys=1)
        assert not any(t["kind"] == "migrate" for t in agent.leased), agent.leased

        async with w.kit.sessions() as s:
            rows = {
                r.task_id: r
                for r in await s.execute(select(agent_tasks).where(agent_tasks.c.task_id.in_([landed, unreadable])))
            }
        assert rows[landed].status == "succeeded" and rows[landed].result == {"kind": "sync_ssh_keys", "keys": 1}
        assert rows[unreadable].status == "failed" and "cannot read a 'migrate' task" in rows[unreadable].error

        async with w.client("owner") as c:
            assert (await c.post(f"/allocations/{aid}/restart")).status_code == 202
        restart = await agent.task_for(aid, "restart")
        r = await agent.client.post(
            f"/agent/tasks/{restart['task_id']}/complete", json={"ok": True, "result": {"network": 5, "gpu": "x"}}
        )
        assert r.status_code == 200, r.text  # a malformed part (the network) is dropped, not the report
        r = await agent.client.post(f"/agent/tasks/{provision['task_id']}/complete", json={"ok": True, "result": {}})
        assert r.status_code == 200 and r.json() == {"applied": False}  # a repeat is a no-op
    finally:
        await agent.aclose()


async def test_a_result_of_the_wrong_shape_is_refused_by_code(world: World) -> None:
    w = world
    host = await w.enrol("shape-host")
    agent = FakeAgent(w.url, host["node_token"])
    try:
        assert (await agent.register(driver="process", isolates_tenants=False)).status_code == 200
        aid = (await w.create("owner")).json()["allocation_id"]
        task = await agent.task_for(aid, "provision")
        r = await agent.client.post(
            f"/agent/tasks/{task['task_id']}/complete", json={"ok": True, "result": {"kind": "release"}}
        )
        assert r.status_code == 422 and r.json()["code"] == "invalid_task_result", r.text
        r = await agent.client.post(
            f"/agent/tasks/{task['task_id']}/complete", json={"ok": True, "result": {"ssh_port": "many"}}
        )
        assert r.status_code == 422 and r.json()["code"] == "invalid_task_result", r.text
        await agent.complete(task, ssh_host="127.0.0.1", ssh_port=2222)  # the task is still open
        await w.wait_status("owner", aid, "active")
    finally:
        await agent.aclose()
