"""SSH access as users meet it: a deleted personal key stops working on every live allocation of its
owner, and a stock OpenSSH client (not asyncssh) logs in to an allocation the node agent serves, pinning
the host key the agent reports."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gpuaas.node_agent.agent import Agent

from .conftest import World, last_seq, ssh_key, ssh_refused, ssh_run, task_done

pytestmark = pytest.mark.integration

OPENSSH = "/usr/bin/ssh"


def installed_keys(agent: Agent, aid: str) -> str:
    return (agent.state_dir / "allocations" / aid / "authorized_keys").read_text()


async def test_deleted_key_is_refused_on_every_live_allocation(world: World) -> None:
    w = world
    _, agent = await w.host_with_agent("gpu-1", "8xH100-80GB")
    old_key, old_pub = ssh_key()
    kept_key, kept_pub = ssh_key()
    async with w.client("owner") as c:
        old = (await c.post("/ssh-keys", json={"name": "old laptop", "public_key": old_pub})).json()
        assert (await c.post("/ssh-keys", json={"name": "new laptop", "public_key": kept_pub})).status_code == 201
        # Two live allocations of the owner, in two projects: both got the personal keys at provisioning.
        allocs = [
            await w.wait_status("owner", (await w.create("owner", project)).json()["allocation_id"], "active")
            for project in ("p1", "p2")
        ]
        for alloc in allocs:
            assert (await ssh_run(alloc, old_key, "echo in")).stdout.strip() == "in"
        before = {a["allocation_id"]: await last_seq(c, a["allocation_id"]) for a in allocs}

        r = await c.delete(f"/ssh-keys/{old['key_id']}")
        assert r.status_code == 204
        assert old["key_id"] not in {k["key_id"] for k in (await c.get("/ssh-keys")).json()}

        for alloc in allocs:
            aid = alloc["allocation_id"]
            await task_done(c, aid, "sync_ssh_keys", before[aid])
            # Once the agent reports the sync, the key is gone from the host and refused at login ...
            installed = installed_keys(agent, aid)
            assert old_pub.split()[1] not in installed and kept_pub.split()[1] in installed
            assert await ssh_refused(alloc, old_key)
            # ... while the owner's other key still gets in.
            assert (await ssh_run(alloc, kept_key, "echo still")).stdout.strip() == "still"
        assert (await c.delete(f"/ssh-keys/{old['key_id']}")).status_code == 404


async def openssh(endpoint: dict[str, Any], identity: Path, known_hosts: Path, command: str) -> tuple[int, str, str]:
    """Run `command` on the allocation with the system's OpenSSH client: no config, no agent, no prompt,
    and the host key checked strictly against `known_hosts` only."""
    proc = await asyncio.create_subprocess_exec(
        OPENSSH,
        "-F",
        "/dev/null",
        "-i",
        str(identity),
        "-p",
        str(endpoint["port"]),
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={known_hosts}",
        "-o",
        "GlobalKnownHostsFile=/dev/null",
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "IdentityAgent=none",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "LogLevel=ERROR",
        f"{endpoint['username']}@{endpoint['host']}",
        command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.skipif(not Path(OPENSSH).exists(), reason="no OpenSSH client on this machine")
async def test_openssh_client_logs_in_to_an_allocation(world: World, tmp_path: Path) -> None:
    w = world
    _, agent = await w.host_with_agent("gpu-1", "8xH100-80GB")
    identity = tmp_path / "id_ed25519"
    keygen = await asyncio.create_subprocess_exec(
        "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "openssh-test", "-f", str(identity)
    )
    assert await keygen.wait() == 0
    async with w.client("owner") as c:
        r = await c.post("/ssh-keys", json={"name": "openssh", "public_key": identity.with_suffix(".pub").read_text()})
        assert r.status_code == 201, r.text
    alloc = await w.wait_status("owner", (await w.create("owner", gpu_count=2)).json()["allocation_id"], "active")
    aid, endpoint = alloc["allocation_id"], alloc["ssh_endpoint"]
    assert endpoint["port"] == agent.ssh_port

    # known_hosts pins the host key the agent reports for its endpoint (non-default port: `[host]:port`).
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[{endpoint['host']}]:{endpoint['port']} {agent.endpoint.host_public_key}\n")
    rc, out, err = await openssh(
        endpoint, identity, known_hosts, "echo $GPUAAS_ALLOCATION_ID; echo $CUDA_VISIBLE_DEVICES"
    )
    assert rc == 0, err
    assert out.split() == [aid, ",".join(map(str, alloc["gpu_indices"]))]
    rc, _, err = await openssh(endpoint, identity, known_hosts, "exit 3")
    assert rc == 3, err

    # The check is real: a known_hosts that pins another key makes the client refuse before running anything.
    other_host_key = ssh_key()[1]
    wrong = tmp_path / "known_hosts.wrong"
    wrong.write_text(f"[{endpoint['host']}]:{endpoint['port']} {other_host_key}\n")
    rc, out, err = await openssh(endpoint, identity, wrong, "echo should-not-run")
    assert rc == 255 and "should-not-run" not in out
    assert "host key" in err.lower(), err
