"""Container driver, two tenants on one host: what one allocation can reach of the other and of the
agent; limits; processes that try to outlive release; a tampered registry blob."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_harness import CONTAINERS_CONF, Host, containers_of, needs_podman

from gpuaas.node_agent.drivers.base import DriverError
from gpuaas.node_agent.drivers.container import container_name

pytestmark = needs_podman


# Forks 1000 sleepers (stdio closed so the session can end), counts the forks the pids limit refused.
FORK_BOMB = (
    "import os, time\n"
    "ok = bad = 0\n"
    "for _ in range(1000):\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except OSError:\n"
    "        bad += 1\n"
    "        continue\n"
    "    if pid == 0:\n"
    "        fd = os.open(os.devnull, os.O_RDWR)\n"
    "        [os.dup2(fd, i) for i in (0, 1, 2)]\n"
    "        time.sleep(60)\n"
    "        os._exit(0)\n"
    "    ok += 1\n"
    "print(ok, bad)"
)


def host_pids_in_container(name: str) -> set[int]:
    """Host pids of every process in the container, read from the host side (its cgroup)."""
    out = subprocess.run(["podman", "top", name, "hpid"], capture_output=True, text=True, check=False).stdout
    return {int(x) for x in out.split()[1:] if x.isdigit()}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_escaped_processes_do_not_survive_release(container_host: Host, runtime: dict[str, str]) -> None:
    h = container_host
    p = h.payload("erin", [0], runtime)
    await h.task("provision", p)
    started = await h.ssh(
        "erin",
        "env -u GPUAAS_ALLOCATION_ID setsid nohup sleep 1001 >/dev/null 2>&1 &"
        " (sh -c 'sleep 1002 &' &) ; env -i /bin/sh -c 'setsid sleep 1003 &' ; sleep 0.3; echo ok",
    )
    assert started.stdout.strip() == "ok"
    pids = {
        pid
        for pid in host_pids_in_container(container_name(p["allocation_id"]))
        if any(f"100{i}" in Path(f"/proc/{pid}/cmdline").read_text() for i in (1, 2, 3))
    }
    assert len(pids) == 3, pids
    evidence = (await h.task("release", p))["evidence"]
    assert evidence["pid_namespace_gone"] and evidence["cgroup_empty"] and evidence["container_removed"]
    assert not [pid for pid in pids if alive(pid)]


async def test_two_tenants_are_isolated(container_host: Host, runtime: dict[str, str]) -> None:
    h = container_host
    limits = {"cpus": 0.5, "memory_mb": 128, "pids": 64}
    vol_a, vol_b = str(uuid.uuid4()), str(uuid.uuid4())  # volume ids are the control plane's UUIDs
    a = h.payload("anna", [0], runtime, limits, [{"volume_id": vol_a, "mount_path": "/data"}])
    b = h.payload("bert", [1], runtime, limits, [{"volume_id": vol_b, "mount_path": "/data"}])
    await asyncio.gather(h.task("provision", a), h.task("provision", b))
    await h.ssh("bert", "echo b-home-xyz > ~/notes; echo b-vol-xyz > /data/notes; nohup sleep 777 >/dev/null 2>&1 &")
    b_pids = host_pids_in_container(container_name(b["allocation_id"]))
    b_ws = h.agent.workspaces.get(b["allocation_id"])
    state = h.agent.state_dir
    token_file = h.agent.s.node_token_file
    checks = {
        "b_process_visible": "ps -eo args | grep -c '[s]leep 777'",
        "kill_b": "; ".join(f"kill -9 {pid} 2>/dev/null && echo killed-{pid}" for pid in b_pids) + "; echo done",
        "b_home": f"cat {b_ws.home}/notes /home/bert/notes 2>&1 | grep -c b-home-xyz || true",
        "b_volume": f"cat {h.agent.workspaces.volumes_root}/{vol_b}/notes 2>&1 | grep -c b-vol-xyz || true",
        "devices": "ls /dev | grep nvidia | tr '\\n' ' '",
        "agent_state": f"ls {state} {token_file} 2>&1 | grep -vc 'No such file' || true",
        "host_root": "sudo -n sh -c 'cat /proc/1/cmdline; echo; ls /proc | grep -c ^[0-9]'",
        "ssh_port": f"timeout 3 bash -c 'echo > /dev/tcp/10.0.2.2/{h.port}' 2>/dev/null && echo open || echo closed",
        "loopback": f"timeout 3 bash -c 'echo > /dev/tcp/127.0.0.1/{h.port}' 2>/dev/null && echo open || echo closed",
    }
    seen = {}
    for key, cmd in checks.items():
        seen[key] = (await h.ssh("anna", cmd)).stdout.strip()
    assert seen["b_process_visible"] == "0", seen
    assert seen["kill_b"] == "done", seen  # no pid of B is signalled from A
    assert all(alive(pid) for pid in b_pids)
    assert seen["b_home"] == "0" and seen["b_volume"] == "0", seen
    assert seen["devices"] == "nvidia0", seen
    assert seen["agent_state"] == "0", seen
    assert "--gpuaas-serve" in seen["host_root"], seen  # PID 1 is the container's own (sudo broker), not the host's
    assert int(seen["host_root"].split()[-1]) < 20, seen
    assert seen["ssh_port"] == "closed" and seen["loopback"] == "closed", seen
    assert (await h.ssh("bert", "cat ~/notes /data/notes")).stdout.split() == ["b-home-xyz", "b-vol-xyz"]

    # A memory hog and a fork bomb in A: A is limited, B keeps answering.
    hog = await h.ssh("anna", "python3 -c 'b = bytearray(512 * 1024 * 1024); print(len(b))'; echo rc=$?")
    assert "rc=137" in hog.stdout or "MemoryError" in hog.stderr, (hog.stdout, hog.stderr)
    bomb = asyncio.create_task(h.ssh("anna", f"python3 -c '{FORK_BOMB}'"))
    await asyncio.sleep(1)
    t0 = time.monotonic()
    assert (await h.ssh("bert", "echo alive")).stdout.strip() == "alive"
    b_latency = time.monotonic() - t0
    forked, refused = (int(x) for x in (await bomb).stdout.split())
    assert refused > 0 and forked < limits["pids"], (forked, refused)
    assert len(host_pids_in_container(container_name(a["allocation_id"]))) <= limits["pids"]
    assert b_latency < 10, b_latency

    for p in (a, b):
        await h.task("release", p)
    assert containers_of(h.agent) == []


def push_tampered_image(registry: Any, tmp_path: Path) -> tuple[str, str]:
    """(ref, digest) of a one-layer image of its own, pushed and then tampered with in the registry."""
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    (tmp_path / "rootfs").mkdir()
    (tmp_path / "rootfs" / "payload").write_bytes(os.urandom(4096))
    subprocess.run(["tar", "-C", str(tmp_path / "rootfs"), "-cf", str(tmp_path / "img.tar"), "."], check=True)
    local = f"localhost/gpuaas-test/tampered:{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["podman", "import", "-q", str(tmp_path / "img.tar"), local], env=env, check=True, capture_output=True
    )
    remote = f"{registry.address}/runtimes/tampered:1"
    digestfile = tmp_path / "digest"
    subprocess.run(
        ["podman", "push", "-q", "--tls-verify=false", "--digestfile", str(digestfile), local, remote],
        env=env,
        check=True,
    )
    subprocess.run(["podman", "rmi", "-f", local], env=env, check=True, capture_output=True)
    digest = digestfile.read_text().strip()
    ref = f"{registry.address}/runtimes/tampered@{digest}"
    manifest = httpx.get(
        f"{registry.url}/v2/runtimes/tampered/manifests/{digest}",
        headers={
            "Accept": "application/vnd.oci.image.manifest.v1+json,application/vnd.docker.distribution.manifest.v2+json"
        },
    ).json()
    blob = registry.blob_file(manifest["layers"][0]["digest"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))

    return ref, digest


async def test_tampered_registry_blob_is_refused(container_host: Host, registry: Any, tmp_path: Path) -> None:
    """A one-layer image of its own (so removing it locally touches nothing else), pushed, then one
    byte of its layer blob flipped in the registry's storage: the registry still serves it, the agent's
    pull by digest must refuse it. A reference whose digest is not the payload's is refused too."""
    ref, digest = await asyncio.to_thread(push_tampered_image, registry, tmp_path)
    h = container_host
    with pytest.raises(DriverError, match="could not be pulled") as refused:
        await h.task("provision", h.payload("tina", [], {"image": ref, "digest": digest}))
    assert "digest" in str(refused.value).lower(), refused.value
    other = "sha256:" + "0" * 64
    with pytest.raises(DriverError, match="not pinned by its digest"):
        await h.task("provision", h.payload("tom", [], {"image": ref, "digest": other}))
    assert containers_of(h.agent) == []
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    images = await asyncio.to_thread(subprocess.run, ["podman", "images", "-q", ref], env=env, capture_output=True)
    assert images.stdout.strip() == b""
