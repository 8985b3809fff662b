"""The process driver: everything a session starts is found at release through the allocation's
cgroup, whatever it does to its environment or session (scrubbed env, double fork, setsid)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agent_harness import Host


def pids_running(marker: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            out.append(int(entry.name))
    return out


ESCAPES = (
    "env -u GPUAAS_ALLOCATION_ID setsid nohup sleep {n}1 >/dev/null 2>&1 & "
    "(sh -c 'sleep {n}2 >/dev/null 2>&1 &' &) ; "
    "env -i /bin/sh -c 'setsid sleep {n}3 >/dev/null 2>&1 &' ; sleep 0.3; echo ok"
)


async def test_scrubbed_env_double_fork_and_setsid_do_not_survive(process_host: Host) -> None:
    h = process_host
    assert h.agent.driver.name == "process" and h.agent.driver.isolates_tenants is False
    p = h.payload("paul", [0, 1])
    await h.task("provision", p)
    run = await h.ssh("paul", "echo $CUDA_VISIBLE_DEVICES; pwd; " + ESCAPES.format(n=7771))
    assert run.stdout.split() == ["0,1", str(h.agent.workspaces.get(p["allocation_id"]).home), "ok"], run.stdout
    assert len(await asyncio.to_thread(pids_running, "sleep 7771")) == 3

    await h.task("restart", p)  # a restart stops them too
    assert await asyncio.to_thread(pids_running, "sleep 7771") == []

    await h.ssh("paul", ESCAPES.format(n=7772))
    assert len(await asyncio.to_thread(pids_running, "sleep 7772")) == 3
    evidence = (await h.task("release", p))["evidence"]
    assert evidence["cgroup_empty"] is True and evidence["state_dir_gone"] is True, evidence
    assert evidence["processes_left"] == [] and evidence["driver"] == "process"
    assert any(c.startswith("cgroup /sys/fs/cgroup/") for c in evidence["checked"]), evidence
    assert await asyncio.to_thread(pids_running, "sleep 7772") == []
