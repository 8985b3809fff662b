"""Container driver, one allocation: provision -> exec as its non-root user -> restart keeps files ->
resize changes devices -> release leaves no container, mount or directory, and says what it checked."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import asyncssh
import pytest
from agent_harness import Host, containers_of, needs_podman, podman

from gpuaas.node_agent.drivers.container import container_name

pytestmark = needs_podman


async def test_provision_exec_restart_resize_release(container_host: Host, runtime: dict[str, str]) -> None:
    h = container_host
    vol = {"volume_id": str(uuid.uuid4()), "mount_path": "/data"}
    p = h.payload("alice", [1], runtime, {"cpus": 1, "memory_mb": 256, "pids": 200}, [vol])
    result = await h.task("provision", p)
    assert result["username"] == "alice" and result["driver"] == "container"
    name = container_name(p["allocation_id"])
    assert containers_of(h.agent) == [name]

    probe = await h.ssh(
        "alice",
        "id -un; id -u; pwd; echo $CUDA_VISIBLE_DEVICES; ls /dev | grep nvidia; cat /proc/self/uid_map;"
        " cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/pids/pids.max;"
        " echo kept > ~/file; echo vol > /data/file; sudo -n id -u",
    )
    lines = probe.stdout.split()
    assert probe.exit_status == 0, probe.stderr
    assert lines[:5] == ["alice", "1000", "/home/alice", "1", "nvidia1"]
    uid_map = [int(x) for x in lines[5:8]]
    assert uid_map[0] == 0 and uid_map[1] >= 100000, f"root inside must be unprivileged on the host: {uid_map}"
    assert lines[8:10] == [str(256 * 1024 * 1024), "200"]
    assert lines[10] == "0"  # sudo inside the container is root of the container only
    tty = await h.ssh("alice", "tty; echo $TERM; id -un", term_type="xterm-256color")
    assert tty.stdout.split()[0].startswith("/dev/pts/"), tty.stdout  # podman exec -t on the agent's pty
    assert tty.stdout.split()[1:] == ["xterm-256color", "alice"], tty.stdout
    ws = h.agent.workspaces.get(p["allocation_id"])
    assert os.stat(ws.home / "file").st_uid == uid_map[1] + 1000  # the mapped uid owns the files on the host
    assert (h.agent.workspaces.volumes_root / vol["volume_id"] / "file").read_text() == "vol\n"

    # Restart: processes are gone, the workspace, keys and volumes are kept.
    await h.ssh("alice", "nohup sleep 600 >/dev/null 2>&1 & echo started")
    await h.task("restart", p)
    after = await h.ssh("alice", "cat ~/file /data/file; pgrep -c -u alice sleep || true")
    assert after.stdout.split() == ["kept", "vol", "0"], after.stdout

    # Resize: the container is recreated with the new device set.
    resized = await h.task("resize", {**p, "gpu_indices": [0, 2]})
    assert resized["gpu_indices"] == [0, 2]
    devices = await h.ssh("alice", "ls /dev | grep nvidia | tr '\\n' ' '; echo $CUDA_VISIBLE_DEVICES; cat ~/file")
    assert devices.stdout.split() == ["nvidia0", "nvidia2", "0,2", "kept"], devices.stdout

    # Release: the container, its cgroups, its PID namespace, its mounts and the state dir are gone.
    released = await h.task("release", p)
    evidence = released["evidence"]
    for key in ("container_removed", "cgroup_empty", "pid_namespace_gone", "mounts_gone", "state_dir_gone"):
        assert evidence[key] is True, evidence
    assert any("pid namespace pid:[" in c for c in evidence["checked"]), evidence["checked"]
    assert any("cgroup /sys/fs/cgroup/" in c for c in evidence["checked"]), evidence["checked"]
    assert containers_of(h.agent) == []
    assert not ws.root.exists()
    assert name not in Path("/proc/self/mountinfo").read_text()
    assert podman("container", "exists", name, check=False) == ""
    with pytest.raises(asyncssh.PermissionDenied):
        await h.ssh("alice", "true")  # no active allocation for the account any more
