"""The `gpuaas` CLI as a process against the whole suite: login (wrong password → a clear problem, exit 1),
keys, volumes, alloc create --wait (timeline followed to active), list/show --json, ssh --print, a command
over SSH with the printed endpoint, resize --wait, restart --wait, release --wait, apps list, cost, logout."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import asyncssh
import httpx
import pytest

from gpuaas.devstack.stack import Stack

from .conftest import eventually
from .test_allocations_gateway import start_agent, stop_agent

pytestmark = pytest.mark.e2e
PASSWORD = "cli-horse-battery-staple"


class Cli:
    def __init__(self, stack: Stack, config: Path) -> None:
        self.env = {
            **os.environ,
            "GPUAAS_URL": stack.gateway_url,
            "GPUAAS_CONFIG": str(config),
            "COLUMNS": "200",
        }

    async def __call__(self, *args: str, ok: bool = True) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gpuaas.cli",
            *args,
            env=self.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 400)
        rc = proc.returncode
        assert rc is not None
        if ok:
            assert rc == 0, (args, rc, out.decode()[-2000:], err.decode()[-2000:])
        return rc, out.decode(), err.decode()

    async def json(self, *args: str) -> Any:
        _, out, _ = await self("--json", *args)
        return json.loads(out)


async def test_cli_against_the_stack(stack: Stack, gw: httpx.AsyncClient, tmp_path: Path) -> None:
    run = uuid.uuid4().hex[:6]
    r = await gw.post("/api/identity/tenants", json={"slug": f"cli-{run}", "name": f"CLI {run}"})
    assert r.status_code == 201, r.text
    tid = r.json()["tenant_id"]
    r = await gw.post(f"/api/identity/tenants/{tid}/projects", json={"name": "cli"})
    assert r.status_code == 201, r.text
    pid = r.json()["project_id"]
    email = f"grace-{run}@cli-{run}.example.com"
    r = await gw.post(f"/api/identity/tenants/{tid}/users", json={"email": email, "password": PASSWORD, "role": None})
    assert r.status_code == 201, r.text
    member = {"user_id": r.json()["user_id"], "role": "project_admin"}
    r = await gw.post(f"/api/identity/projects/{pid}/members", json=member)
    assert r.status_code == 201, r.text
    host_class = f"cli-{run}"
    r = await gw.post("/api/allocations/hosts", json={"name": host_class, "host_class": host_class})
    assert r.status_code == 201, r.text
    host = r.json()
    agent = start_agent(stack, host["node_token"], host_class, "4xH100-80GB")
    cli = Cli(stack, tmp_path / "config.json")
    try:
        rc, _, err = await cli("login", "--email", email, "--password", "wrong-password", ok=False)
        assert rc == 1 and "error:" in err and "HTTP 401" in err, err
        await cli("login", "--email", email, "--password", PASSWORD)
        config = json.loads((tmp_path / "config.json").read_text())
        assert config["project_id"] == pid and config["refresh_token"]
        assert (tmp_path / "config.json").stat().st_mode & 0o077 == 0
        me = await cli.json("whoami")
        assert me["email"] == email

        key = asyncssh.generate_private_key("ssh-ed25519")
        (tmp_path / "id.pub").write_bytes(key.export_public_key())
        added = await cli.json("keys", "add", "laptop", str(tmp_path / "id.pub"))
        assert [k["key_id"] for k in await cli.json("keys", "list")] == [added["key_id"]]
        vol = await cli.json("volumes", "create", "data", "--size", "10")
        assert vol["name"] == "data" and vol in await cli.json("volumes", "list")

        async def host_ready() -> bool:
            return (await gw.get(f"/api/allocations/hosts/{host['host_id']}")).json().get("status") == "ready"

        await eventually(host_ready, 60, "host ready")

        async def create() -> Any:  # allocations' IAM projection catches up with identity
            rc, out, _err = await cli(
                "--json", "alloc", "create", "--name", "cli", "--gpus", "1", "--host-class", host_class,
                "--volume", vol["volume_id"], "--wait", "--timeout", "120", ok=False,
            )  # fmt: skip
            return json.loads(out) if rc == 0 else None

        alloc = await eventually(create, 60, "alloc create --wait", interval_s=1)
        aid = alloc["allocation_id"]
        assert alloc["status"] == "active" and alloc["ssh_endpoint"]
        listed = await cli.json("alloc", "list")
        assert [a["allocation_id"] for a in listed] == [aid]
        shown = await cli.json("alloc", "show", aid)
        assert {"provision"} <= {e["phase"] for e in shown["timeline"]} or len(shown["timeline"]) >= 2
        # The progress display (stderr, plain lines when not a terminal) names the phases as they happen.
        _, table_out, _ = await cli("alloc", "show", aid)
        assert aid in table_out and "Timeline" in table_out

        argv = (await cli.json("alloc", "ssh", aid, "--print"))["argv"]
        port, target = int(argv[argv.index("-p") + 1]), argv[-1]
        user, hostname = target.split("@")
        async with asyncssh.connect(
            hostname, port, username=user, client_keys=[key], known_hosts=None, agent_path=None, config=None
        ) as conn:
            assert (await conn.run("echo cli-$((6*7))", check=True, timeout=20)).stdout.strip() == "cli-42"

        resized = await cli.json("alloc", "resize", aid, "2", "--wait", "--timeout", "120")
        assert resized["status"] == "active" and resized["gpu_count"] == 2
        restarted = await cli.json("alloc", "restart", aid, "--wait", "--timeout", "120")
        assert restarted["status"] == "active" and restarted["allocation_id"] == aid
        rc, _, err = await cli("alloc", "resize", aid, "64", ok=False)
        assert rc == 1 and "error:" in err  # more GPUs than the host has: a problem, not a traceback
        assert "Traceback" not in err
        released = await cli.json("alloc", "release", aid, "--wait", "--timeout", "120")
        assert released["status"] == "released"

        apps = await cli.json("apps", "list")
        assert isinstance(apps, list)
        cost = await cli.json("cost")
        assert cost["period_start"] and isinstance(cost["projects"], list)
        await cli("logout")
        assert json.loads((tmp_path / "config.json").read_text())["access_token"] is None
        rc, _, err = await cli("alloc", "list", ok=False)
        assert rc == 1 and "gpuaas login" in err
    finally:
        stop_agent(agent)
