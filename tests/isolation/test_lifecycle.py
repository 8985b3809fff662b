"""An allocation's container through its life: restart keeps the workspace, the volume and the keys (and
the host key the endpoint presents); resize recreates it with the new device set; release leaves no
container, mount or directory. The agent SIGKILLed in the middle of a provision and of a release leaves no
orphan container once it is back."""

from __future__ import annotations

import shlex
import uuid
from typing import Any

import pytest

from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually

from .harness import A, Agent, Tenant, connect, containers_of, in_thread, mounts_naming, out, paths_naming

pytestmark = pytest.mark.e2e


async def devices(alloc: dict[str, Any], tenant: Tenant) -> set[str]:
    return set((await out(alloc, tenant.key, "ls /dev | grep -E '^nvidia[0-9]+$' || true")).split())


async def host_key(alloc: dict[str, Any], tenant: Tenant) -> str:
    async with connect(alloc, tenant.key) as conn:
        return conn.get_server_host_key().export_public_key().decode().strip()


def left_behind(agent: Agent, allocation_id: str) -> dict[str, list[Any]]:
    """What of this allocation is still on the host: containers, mounts, files under the agent's state."""
    return {
        "containers": containers_of(allocation_id),
        "mounts": mounts_naming(allocation_id),
        "paths": paths_naming(agent.state_dir, allocation_id),
    }


async def test_restart_resize_release(host: Agent, tenants: tuple[Tenant, Tenant]) -> None:
    owner, _ = tenants
    r = await owner.client.post(f"{A}/projects/{owner.project_id}/volumes", json={"name": "keep", "size_gb": 1})
    assert r.status_code == 201, r.text
    volume = r.json()["volume_id"]
    alloc = await owner.active(
        gpu_model="H100-80GB", gpu_count=1, host_class=host.host_class, name="life", volume_ids=[volume]
    )
    aid = alloc["allocation_id"]
    assert alloc["driver"] == "container" and alloc["runtime"] and alloc["runtime"]["digest"].startswith("sha256:")
    assert await in_thread(containers_of, aid) == [f"gpuaas-{aid}"]
    vols = (await owner.client.get(f"{A}/projects/{owner.project_id}/volumes")).json()
    mount = next(a["mount_path"] for v in vols if v["volume_id"] == volume for a in v["attachments"])
    stamp = uuid.uuid4().hex
    await out(alloc, owner.key, f"echo {stamp} > ~/ws.txt && echo {stamp} > {shlex.quote(mount)}/vol.txt")
    key_before = await host_key(alloc, owner)
    assert await devices(alloc, owner) == {f"nvidia{i}" for i in alloc["gpu_indices"]}

    # Restart: the same container name comes back with the workspace, the volume and the keys.
    await owner.act(aid, "restart")
    restarted = await owner.wait(aid, "active")
    assert restarted["ssh_endpoint"] == alloc["ssh_endpoint"]
    kept = await out(restarted, owner.key, f"cat ~/ws.txt {shlex.quote(mount)}/vol.txt")
    assert kept.split() == [stamp, stamp]
    assert await host_key(restarted, owner) == key_before

    # Resize: the container is recreated with the new devices (and CUDA_VISIBLE_DEVICES to match).
    await owner.act(aid, "resize", {"gpu_count": 3})
    resized = await owner.wait(aid, "active")
    assert resized["gpu_count"] == 3 and len(resized["gpu_indices"]) == 3
    assert await devices(resized, owner) == {f"nvidia{i}" for i in resized["gpu_indices"]}
    cuda = (await out(resized, owner.key, "echo $CUDA_VISIBLE_DEVICES")).strip()
    assert cuda == ",".join(map(str, resized["gpu_indices"]))
    assert (await out(resized, owner.key, "cat ~/ws.txt")).strip() == stamp
    await owner.act(aid, "resize", {"gpu_count": 1})
    shrunk = await owner.wait(aid, "active")
    assert await devices(shrunk, owner) == {f"nvidia{i}" for i in shrunk["gpu_indices"]}

    # Release: nothing of it is left on the host; the persistent volume's data stays, for the next one.
    await owner.release(aid)
    assert await in_thread(left_behind, host, aid) == {"containers": [], "mounts": [], "paths": []}
    again = await owner.active(
        gpu_model="H100-80GB", gpu_count=1, host_class=host.host_class, name="life-2", volume_ids=[volume]
    )
    assert (await out(again, owner.key, f"cat {shlex.quote(mount)}/vol.txt")).strip() == stamp
    assert (await out(again, owner.key, "cat ~/ws.txt 2>/dev/null || echo fresh")).strip() == "fresh"
    await owner.release(again["allocation_id"])


async def _task_leased(stack: Stack, allocation_id: str, kind: str) -> bool:
    sql = "SELECT status FROM agent_tasks WHERE allocation_id = $1 AND kind = $2 ORDER BY seq DESC LIMIT 1"
    return await stack.fetchval("allocations", sql, uuid.UUID(allocation_id), kind) == "leased"


async def orphans(stack: Stack, agent: Agent) -> dict[str, list[str]]:
    """Containers on this host for allocations of the agent's host that are not active (other sessions
    on the machine run their own containers: only this host's allocations are looked at)."""
    sql = "SELECT allocation_id, status FROM allocations WHERE host_id = $1"
    rows = await stack.fetch("allocations", sql, uuid.UUID(agent.host_id))
    left = {}
    for r in rows:
        names = await in_thread(containers_of, str(r["allocation_id"]))
        if names and r["status"] != "active":
            left[str(r["allocation_id"])] = names
    return left


async def test_agent_killed_mid_provision_and_mid_release_leaves_no_orphan(
    stack: Stack, host: Agent, tenants: tuple[Tenant, Tenant]
) -> None:
    owner, _ = tenants

    # Mid-provision: the agent has taken the provision task and is pulling / creating when it dies.
    created = await owner.create(gpu_model="H100-80GB", gpu_count=1, host_class=host.host_class, name="crash")
    aid = created["allocation_id"]
    await eventually(lambda: _task_leased(stack, aid, "provision"), 60, "provision task taken", interval_s=0.02)
    host.kill()
    host.start()
    alloc = await owner.wait(aid, "active", "failed", timeout_s=240)
    expected = [f"gpuaas-{aid}"] if alloc["status"] == "active" else []
    assert await in_thread(containers_of, aid) == expected, alloc
    if alloc["status"] == "active":
        assert (await out(alloc, owner.key, "echo up")).strip() == "up"

    # Mid-release: the agent has taken the release task when it dies.
    await owner.act(aid, "release")
    await eventually(lambda: _task_leased(stack, aid, "release"), 60, "release task taken", interval_s=0.02)
    host.kill()
    host.start()
    released = await owner.wait(aid, "released", "release_failed", timeout_s=240)
    if released["status"] == "release_failed":  # the reason is recorded; a retry finishes it
        await owner.act(aid, "retry-release")
        released = await owner.wait(aid, "released", timeout_s=240)
    assert await in_thread(left_behind, host, aid) == {"containers": [], "mounts": [], "paths": []}
    # No container of any of this host's allocations is left that is not accounted for.
    assert await orphans(stack, host) == {}
