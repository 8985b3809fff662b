"""Two tenants' allocations on one container host. From inside A: B's processes are invisible and
unkillable, B's workspace and volume are unreadable, B's GPU device nodes are absent, the agent's node
token and state directory are unreachable; A's SSH user is not root on the host."""

from __future__ import annotations

import shlex

import pytest

from .harness import Agent, Tenant, container_pid, host_pids, host_uid, in_thread, marker, out, sh

pytestmark = pytest.mark.e2e
A = "/api/allocations"
# Every process's environment and command line visible here, searched for what comes on stdin (this
# process and its parents, which never saw it, excluded).
FIND_ON_STDIN = """
import glob, os, sys
secret = sys.stdin.read().strip().encode()
assert secret
for path in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline"):
    try:
        if secret in open(path, "rb").read():
            print(path)
    except OSError:
        pass
"""


async def test_two_tenants_on_one_host_cannot_reach_each_other(host: Agent, tenants: tuple[Tenant, Tenant]) -> None:
    ta, tb = tenants
    r = await tb.client.post(f"{A}/projects/{tb.project_id}/volumes", json={"name": "b-data", "size_gb": 1})
    assert r.status_code == 201, r.text
    b_volume = r.json()["volume_id"]
    a = await ta.active(gpu_model="H100-80GB", gpu_count=1, host_class=host.host_class, name="tenant-a")
    b = await tb.active(
        gpu_model="H100-80GB", gpu_count=1, host_class=host.host_class, name="tenant-b", volume_ids=[b_volume]
    )
    assert a["host_id"] == b["host_id"] == host.host_id, "both tenants were to share the one container host"
    assert a["driver"] == b["driver"] == "container"
    assert set(a["gpu_indices"]).isdisjoint(b["gpu_indices"])

    # B leaves a process, a workspace file and a volume file behind.
    secret, job = f"b-secret-{marker()}", marker()
    vols = (await tb.client.get(f"{A}/projects/{tb.project_id}/volumes")).json()
    mount = next(
        att["mount_path"]
        for v in vols
        if v["volume_id"] == b_volume
        for att in v.get("attachments", [])
        if att["allocation_id"] == b["allocation_id"]
    )
    await out(
        b,
        tb.key,
        f"echo {secret} > ~/secret.txt && echo {secret} > {shlex.quote(mount)}/secret.txt && "
        f"(setsid sleep {job} >/dev/null 2>&1 </dev/null &) ; echo ok",
    )
    [b_job] = host_pids(f"sleep {job}")
    b_files = [p for p in host.state_dir.parent.parent.rglob("secret.txt") if secret in p.read_text()]
    assert len(b_files) >= 1, "B's files were not found on the host: the test could not aim at them"

    # Processes: B's job is neither listed nor killable from A (by its host pid, by name, by any pid).
    a_ps = await out(a, ta.key, "ps -eo pid,args")
    assert f"sleep {job}" not in a_ps and secret not in a_ps
    # (the pattern's brackets keep pkill from matching this very shell's command line)
    pattern = f"sleep [{job[0]}]{job[1:]}"
    kill = await sh(a, ta.key, f"kill -9 {b_job}; sudo kill -9 {b_job}; pkill -9 -f '{pattern}'; echo done")
    assert "done" in kill.stdout and "No such process" in kill.stderr, (kill.stdout, kill.stderr)
    # root in A signalling every process it can see (this ends A's own session too)
    await sh(a, ta.key, "sudo kill -9 -1")
    assert host_pids(f"sleep {job}") == [b_job], "B's job was killed from A"

    # Files: B's workspace and volume, by B's paths and by their host paths, do not exist for A.
    probes = [f"/home/{b['ssh_endpoint']['username']}/secret.txt", f"{mount}/secret.txt", *map(str, b_files)]
    for path in probes:
        r = await sh(a, ta.key, f"sudo cat {shlex.quote(path)}")
        assert secret not in r.stdout, f"A read B's {path}"
    grep = f"sudo grep -rsl -D skip --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev {secret} / ; true"
    found = await sh(a, ta.key, grep, 180)
    assert found.stdout.strip() == "", f"A found B's secret at {found.stdout}"

    # GPUs: exactly A's device nodes, none of B's; CUDA_VISIBLE_DEVICES says the same.
    nodes = set((await out(a, ta.key, "ls /dev | grep -E '^nvidia[0-9]+$' || true")).split())
    assert nodes == {f"nvidia{i}" for i in a["gpu_indices"]}, nodes
    assert not nodes & {f"nvidia{i}" for i in b["gpu_indices"]}
    cuda = (await out(a, ta.key, "echo $CUDA_VISIBLE_DEVICES")).strip()
    assert cuda == ",".join(map(str, a["gpu_indices"]))

    # The agent: its token (file and environment) and its state directory are out of reach.
    token = host.token_file.read_text().strip()
    for path in (host.token_file, host.state_dir):
        r = await sh(a, ta.key, f"sudo ls -la {shlex.quote(str(path))}; sudo cat {shlex.quote(str(path))}")
        assert r.exit_status != 0 and token not in r.stdout, f"A reached {path}"
    # (the token goes in on stdin: on a command line, sudo's SUDO_COMMAND would carry it into the probe's env)
    probe = f"sudo python3 -c {shlex.quote(FIND_ON_STDIN)}"
    control = marker()  # the probe finds what is there: a process of A's own
    await out(a, ta.key, f"(setsid sleep {control} >/dev/null 2>&1 </dev/null &); echo ok")
    assert "/cmdline" in (await sh(a, ta.key, probe, stdin=f"sleep\0{control}")).stdout
    environs = await sh(a, ta.key, probe, stdin=token)
    assert environs.exit_status == 0 and environs.stdout.strip() == "", (environs.stdout, environs.stderr)
    cmdlines = await out(a, ta.key, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '; true")
    assert "gpuaas.node_agent" not in cmdlines and "sleep " + job not in cmdlines

    # Not root on the host: the SSH user is not uid 0 inside, and its processes are not root outside.
    assert (await out(a, ta.key, "id -u")).strip() != "0"
    own = marker()
    await out(a, ta.key, f"(setsid sleep {own} >/dev/null 2>&1 </dev/null &); echo ok")
    [a_job] = host_pids(f"sleep {own}")
    assert host_uid(a_job) != 0, "A's SSH user runs as root on the host"
    # ... and neither is root inside the container once sudo'd: it maps to an unprivileged host uid.
    root_inside = marker()
    await out(a, ta.key, f"sudo sh -c '(setsid sleep {root_inside} >/dev/null 2>&1 </dev/null &)'; echo ok")
    [a_root] = host_pids(f"sleep {root_inside}")
    assert host_uid(a_root) != 0, "root inside A's container is root on the host"
    assert await in_thread(container_pid, a["allocation_id"]) != await in_thread(container_pid, b["allocation_id"])

    for t, alloc in ((ta, a), (tb, b)):
        await t.release(alloc["allocation_id"])
    assert host_pids(f"sleep {job}") == [] and host_pids(f"sleep {own}") == []
