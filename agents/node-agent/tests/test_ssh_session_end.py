"""A key sync that removes a key ends that key's open SSH sessions (issue 28), with either driver: the
connection is closed, what the session started is killed where it runs (on the host with the process
driver, inside the container with the container driver: there the processes live under conmon, not under
the `podman exec` client the endpoint started), and the key is refused at the next login. Another key's
session on the same allocation goes on."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncssh
import pytest
from agent_harness import Host, needs_podman, podman

from gpuaas.node_agent.drivers.container import container_name


async def open_session(h: Host, username: str, key: asyncssh.SSHKey) -> tuple[asyncssh.SSHClientConnection, Any, int]:
    conn = await asyncssh.connect(
        "127.0.0.1", h.port, username=username, client_keys=[key], known_hosts=None, agent_path=None, config=None
    )
    proc = await conn.create_process("sleep 600 & echo $!; wait")
    pid = int((await asyncio.wait_for(proc.stdout.readline(), 30)).strip())
    return conn, proc, pid


def alive(h: Host, alloc_id: str, pid: int) -> bool:
    """Whether the session's job still runs where the driver runs it (not a zombie)."""
    if h.agent.driver.name == "container":
        state = podman("exec", container_name(alloc_id), "sh", "-c", f"cat /proc/{pid}/stat 2>/dev/null", check=False)
    else:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read()
        except OSError:
            return False
    return bool(state.strip()) and state[state.rfind(")") + 2] != "Z"


async def check_session_end(h: Host, runtime: dict[str, str] | None) -> None:
    p = h.payload("alice", [0], runtime, {"cpus": 1, "memory_mb": 256, "pids": 200} if runtime else None)
    removed = h.keys["alice"]
    kept = asyncssh.generate_private_key("ssh-ed25519")
    kept_line = kept.export_public_key().decode().strip()
    p["authorized_keys"].append(kept_line)
    await h.task("provision", p)
    conn, proc, pid = await open_session(h, "alice", removed)
    other_conn, other_proc, other_pid = await open_session(h, "alice", kept)
    assert alive(h, p["allocation_id"], pid) and alive(h, p["allocation_id"], other_pid)

    sync = {"allocation_id": p["allocation_id"], "username": "alice", "authorized_keys": [kept_line]}
    result = await h.task("sync_ssh_keys", sync)
    assert result["keys"] == 1 and result["sessions_closed"] == 1, result

    await asyncio.wait_for(proc.wait(), 5)  # the removed key's connection is closed ...
    assert not alive(h, p["allocation_id"], pid), "the removed key's session left its job running"
    with pytest.raises(asyncssh.PermissionDenied):  # ... and its next login refused
        await asyncssh.connect(
            "127.0.0.1", h.port, username="alice", client_keys=[removed], known_hosts=None, agent_path=None, config=None
        )
    assert other_proc.exit_status is None and alive(h, p["allocation_id"], other_pid)
    conn.close()
    other_conn.close()
    await h.task("release", {"allocation_id": p["allocation_id"], "username": "alice"})


async def test_removed_key_session_ends_process_driver(process_host: Host) -> None:
    await check_session_end(process_host, None)


@needs_podman
async def test_removed_key_session_ends_container_driver(container_host: Host, runtime: dict[str, str]) -> None:
    await check_session_end(container_host, runtime)
