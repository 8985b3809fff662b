"""The agent SIGKILLed part-way through provision or release leaves no orphan container once it
restarts (reconcile on start), and an active allocation whose container vanished is brought back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from agent_harness import Host, agent_settings, containers_of, needs_podman, start_host, stop_host

from gpuaas.node_agent.drivers.container import container_name

pytestmark = needs_podman
RUN_TASK = Path(__file__).with_name("run_task.py")


async def kill_when(tmp: Path, host: Host, kind: str, payload: dict, ready) -> int | None:
    """Run the task in a child agent process and SIGKILL it once `ready()` holds; its exit code."""
    settings = tmp / f"{kind}-settings.json"
    settings.write_text(host.agent.s.model_dump_json(exclude={"node_token"}))
    task = tmp / f"{kind}-task.json"
    task.write_text(json.dumps({"task_id": str(uuid.uuid4()), "kind": kind, "payload": payload}))
    proc = await asyncio.create_subprocess_exec(sys.executable, str(RUN_TASK), str(settings), str(task))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.returncode is None:
        if await asyncio.to_thread(ready):
            os.kill(proc.pid, signal.SIGKILL)
            break
        await asyncio.sleep(0.01)
    return await proc.wait()


async def test_sigkill_mid_provision_and_mid_release_leave_no_orphan(tmp_path: Path, runtime: dict[str, str]) -> None:
    state = tmp_path / "agent"
    host = await start_host(agent_settings(state, "container"))
    try:
        # Mid-provision: killed as soon as its container exists (before it is started and activated).
        p1 = host.payload("kate", [0], runtime)
        name1 = container_name(p1["allocation_id"])
        rc = await kill_when(tmp_path, host, "provision", p1, lambda: name1 in containers_of(host.agent))
        assert rc == -signal.SIGKILL
        assert name1 in containers_of(host.agent)  # the half-made container is there...

        # Mid-release: an active allocation, killed once release has begun.
        p2 = host.payload("lena", [1], runtime)
        await host.task("provision", p2)
        ws2 = host.agent.workspaces.get(p2["allocation_id"])
        rc = await kill_when(tmp_path, host, "release", p2, lambda: ws2.status == "releasing")
        assert rc == -signal.SIGKILL

        # An active allocation whose container was removed behind the agent's back.
        p3 = host.payload("mara", [2], runtime)
        await host.task("provision", p3)
        await host.agent.driver.podman.remove(container_name(p3["allocation_id"]))
        # And a container labelled for this agent that it has no record of.
        stray = host.payload("nina", [3], runtime)
        await host.task("provision", stray)
        host.agent.workspaces.remove(host.agent.workspaces.get(stray["allocation_id"]))
    finally:
        await stop_host(host)

    restarted = await start_host(agent_settings(state, "container"))
    restarted.keys = host.keys
    try:
        report = restarted.agent.reconciled
        removed = {r["allocation_id"]: r["reason"] for r in report["removed"]}
        assert removed.get(p1["allocation_id"]) == "allocation provisioning", report
        if ws2.root.exists():  # killed before the container went: reconcile removes it
            assert removed.get(p2["allocation_id"]) == "allocation releasing", report
        assert removed.get(stray["allocation_id"]) == "unknown allocation", report
        assert [r["allocation_id"] for r in report["recreated"]] == [p3["allocation_id"]], report
        assert containers_of(restarted.agent) == [container_name(p3["allocation_id"])]
        assert (await restarted.ssh("mara", "echo back")).stdout.strip() == "back"
        # The redelivered tasks finish the job: provision makes p1 whole, release verifies p2 is gone.
        await restarted.task("provision", p1)
        evidence = (await restarted.task("release", p2))["evidence"]
        assert evidence["container_removed"] and evidence["state_dir_gone"], evidence
        for p in (p1, p3):
            await restarted.task("release", p)
        assert containers_of(restarted.agent) == []
    finally:
        await stop_host(restarted)
