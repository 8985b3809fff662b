"""The `gpuaas` CLI as a process against the whole suite: login (wrong password → a clear problem, exit 1),
keys add/list/delete, volumes create/list/delete, alloc runtimes, alloc create --runtime --wait (timeline
followed to active; on a stack with the runtime images: the runtime, driver and limits in show), list/show
--json, ssh --print, a command over SSH with the printed endpoint, resize --wait, restart --wait,
grants add/list/remove (a colleague's key), apps list, apps deploy --wait (manifest inputs with -c) on the
allocation with a running app controller, apps status (list, one), add-worker on a second allocation and
remove-worker, decommission --wait, a problem+json error (unknown app: `error: … (code, HTTP 4xx)`,
exit 1, no traceback), release --wait, cost (JSON and table), logout. (`login --sso` is in
test_identity_sso.py, next to the enterprise IdP it needs.)

Issue 21: commands take names and short ids where they take ids (`alloc ssh cli-test`, `grants add` with the
colleague's email, `apps status cli-cluster`, `remove-worker` by a member's short id), tables show short ids
the commands accept, an ambiguous prefix is an error listing the candidates, `whoami` shows tenant and
project names, `apps open` refuses a non-launchable app, `cost --by day` prints the daily series whose
days add up to `cost`, and money carries its currency."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncssh
import httpx
import pytest

from gpuaas.devstack.golden_path.actors import start_agent
from gpuaas.devstack.infra import stop_process
from gpuaas.devstack.pytest_plugin import new_team, target_of
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually

from .test_console import APP, enable_app, registry, start_controller

__all__ = ["registry"]  # the module fixture (a real OCI registry for the seed catalog)

pytestmark = pytest.mark.e2e
PASSWORD = "cli-horse-battery-staple"
MONEY = re.compile(r"\d+\.\d{2,} [A-Z]{3}")


class Cli:
    def __init__(self, stack: Stack, config: Path) -> None:
        self.env = {
            **os.environ,
            "GPUAAS_URL": stack.gateway_url,
            "GPUAAS_CONFIG": str(config),
            "COLUMNS": "200",
        }

    async def spawn(self, *args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gpuaas.cli",
            *args,
            env=self.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    async def __call__(self, *args: str, ok: bool = True) -> tuple[int, str, str]:
        proc = await self.spawn(*args)
        out, err = await asyncio.wait_for(proc.communicate(), 400)
        rc = proc.returncode
        assert rc is not None
        if ok:
            assert rc == 0, (args, rc, out.decode()[-2000:], err.decode()[-2000:])
        return rc, out.decode(), err.decode()

    async def json(self, *args: str) -> Any:
        _, out, _ = await self("--json", *args)
        return json.loads(out)


async def test_cli_against_the_stack(stack: Stack, gw: httpx.AsyncClient, registry: Any, tmp_path: Path) -> None:
    team = await new_team(gw, "cli", "CLI", "cli", "grace", "hal", PASSWORD)
    run, tid, pid, email, colleague = team.run, team.tenant_id, team.project_id, team.admin_email, team.member_id
    host_class = f"cli-{run}"
    r = await gw.post("/api/allocations/hosts", json={"name": host_class, "host_class": host_class})
    assert r.status_code == 201, r.text
    host = r.json()
    agent = start_agent(target_of(stack), host["node_token"], host_class, "4xH100-80GB")
    # A GPU price, so that `cost --by day` has charges to show once the allocations are released.
    r = await gw.post(
        "/api/billing/prices",
        json={"unit": "gpu_hour", "unit_price": "360.00", "currency": "USD", "gpu_model": "H100-80GB"}
        | {"shape": "gpu_slice", "effective_from": "2020-01-01T00:00:00Z"},
    )
    assert r.status_code in (201, 409), r.text
    cli = Cli(stack, tmp_path / "config.json")
    controller = None
    try:
        rc, _, err = await cli("login", "--email", email, "--password", "wrong-password", ok=False)
        assert rc == 1 and "error:" in err and "HTTP 401" in err, err
        await cli("login", "--email", email, "--password", PASSWORD)
        config = json.loads((tmp_path / "config.json").read_text())
        assert config["project_id"] == pid and config["refresh_token"]
        assert (tmp_path / "config.json").stat().st_mode & 0o077 == 0
        me = await cli.json("whoami")
        assert me["email"] == email
        assert {(m["tenant_name"], m["project_name"]) for m in me["memberships"]} == {(f"CLI {run}", "cli")}
        _, whoami_table, _ = await cli("whoami")
        assert f"CLI {run}" in whoami_table and " cli " in whoami_table and pid not in whoami_table

        # --project takes a name (or tenant/name) as well as an id; the project and role reach allocations by event
        async def volumes_by_name() -> Any:
            rc, out, _ = await cli("--json", "--project", f"CLI {run}/cli", "volumes", "list", ok=False)
            return [json.loads(out)] if rc == 0 else None

        assert (await eventually(volumes_by_name, 60, "volumes list by project name", interval_s=0.5)) == [[]]

        key = asyncssh.generate_private_key("ssh-ed25519")
        (tmp_path / "id.pub").write_bytes(key.export_public_key())
        added = await cli.json("keys", "add", "laptop", str(tmp_path / "id.pub"))
        assert [k["key_id"] for k in await cli.json("keys", "list")] == [added["key_id"]]
        vol = await cli.json("volumes", "create", "data", "--size", "10")
        assert vol["name"] == "data" and vol in await cli.json("volumes", "list")

        async def host_ready() -> bool:
            return (await gw.get(f"/api/allocations/hosts/{host['host_id']}")).json().get("status") == "ready"

        await eventually(host_ready, 60, "host ready")

        # The runtime images (container driver) when the stack has them: chosen by digest here.
        base = stack.runtimes.pushed.get("gpuaas-base")
        runtime_args = ["--runtime", base.digest] if base else []
        if base:

            async def offered() -> Any:
                runtimes = await cli.json("alloc", "runtimes")
                return runtimes if {"gpuaas-base", "gpuaas-scipy"} <= {r["slug"] for r in runtimes} else None

            runtimes = await eventually(offered, 60, "runtimes offered", interval_s=1)
            assert base.digest in {r["digest"] for r in runtimes if r["slug"] == "gpuaas-base"}
            _, runtimes_table, _ = await cli("alloc", "runtimes")
            assert "gpuaas-scipy" in runtimes_table and "Runtimes" in runtimes_table

        async def create() -> Any:  # allocations' IAM projection catches up with identity
            rc, out, _err = await cli(
                "--json", "alloc", "create", "--name", "cli-test", "--gpus", "1", "--host-class", host_class,
                "--volume", "data", *runtime_args, "--wait", "--timeout", "120", ok=False,
            )  # fmt: skip
            return json.loads(out) if rc == 0 else None

        alloc = await eventually(create, 60, "alloc create --wait", interval_s=1)
        aid = alloc["allocation_id"]
        assert alloc["status"] == "active" and alloc["ssh_endpoint"]
        listed = await cli.json("alloc", "list")
        assert [a["allocation_id"] for a in listed] == [aid]
        shown = await cli.json("alloc", "show", aid)
        assert {"provision"} <= {e["phase"] for e in shown["timeline"]} or len(shown["timeline"]) >= 2
        assert [v["volume_id"] for v in shown["volumes"]] == [vol["volume_id"]]  # --volume by name
        # Tables show a short id (a unique prefix of at least 8 characters) that the commands take.
        _, list_table, _ = await cli("alloc", "list")
        short = next(w for w in list_table.split() if len(w) >= 8 and aid.startswith(w))
        _, table_out, _ = await cli("alloc", "show", short)
        assert short in table_out and "Timeline" in table_out and "Isolation" in table_out
        assert (await cli.json("alloc", "show", "cli-test"))["allocation_id"] == aid
        if base:
            assert shown["runtime"]["slug"] == "gpuaas-base" and shown["runtime"]["digest"] == base.digest
            assert shown["driver"] == "container" and shown["limits"]["pids"] > 0
            assert f"gpuaas-base {base.version} ({base.digest})" in table_out and "container" in table_out
            rc, _, err = await cli("alloc", "create", "--gpus", "1", "--runtime", "no-such-runtime", ok=False)
            assert rc == 1 and "runtime_unavailable, HTTP 422" in err, err

        argv = (await cli.json("alloc", "ssh", "cli-test", "--print"))["argv"]  # by name (issue 21)
        port, target = int(argv[argv.index("-p") + 1]), argv[-1]
        user, hostname = target.split("@")
        # The host is verified against the key the platform pinned (issue 28), never trusted on first use.
        assert "StrictHostKeyChecking=yes" in argv, argv
        known_hosts = next(a.split("=", 1)[1] for a in argv if a.startswith("UserKnownHostsFile="))
        async with asyncssh.connect(
            hostname, port, username=user, client_keys=[key], known_hosts=known_hosts, agent_path=None, config=None
        ) as conn:
            assert (await conn.run("echo cli-$((6*7))", check=True, timeout=20)).stdout.strip() == "cli-42"

        resized = await cli.json("alloc", "resize", "cli-test", "2", "--wait", "--timeout", "120")
        assert resized["status"] == "active" and resized["gpu_count"] == 2
        restarted = await cli.json("alloc", "restart", aid[:13], "--wait", "--timeout", "120")
        assert restarted["status"] == "active" and restarted["allocation_id"] == aid
        rc, _, err = await cli("alloc", "resize", aid, "64", ok=False)
        assert rc == 1 and "error:" in err  # more GPUs than the host has: a problem, not a traceback
        assert "Traceback" not in err
        # Grants: a colleague's key on this allocation, listed, removed.
        (tmp_path / "hal.pub").write_bytes(asyncssh.generate_private_key("ssh-ed25519").export_public_key())
        hal = f"hal-{run}@cli-{run}.example.com"
        grant = await cli.json("grants", "add", "cli-test", hal.upper(), str(tmp_path / "hal.pub"))
        assert grant["user_id"] == colleague and grant["status"] in ("pending", "active")
        assert grant["grant_id"] in [g["grant_id"] for g in await cli.json("grants", "list", aid)]
        _, grants_table, _ = await cli("grants", "list", aid)
        assert grant["fingerprint"] in grants_table and hal in grants_table
        revoked = await cli.json("grants", "remove", "cli-test", grant["fingerprint"])
        assert revoked["grant_id"] == grant["grant_id"] and revoked["status"] != "active"

        # Apps: deploy onto the allocation (a real app controller runs), add a worker on a second one,
        # remove it, decommission.
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
            r = await c.post(
                "/api/identity/auth/token", data={"grant_type": "password", "username": email, "password": PASSWORD}
            )
        sa = await enable_app(
            gw, registry, tid=tid, pid=pid, user={"Authorization": f"Bearer {r.json()['access_token']}"}, run=run
        )
        controller = start_controller(stack, sa, run)
        assert APP in [a["slug"] for a in await cli.json("apps", "list")]
        _, apps_table, _ = await cli("apps", "list")
        assert APP in apps_table and "cluster_name" in apps_table
        worker = await cli.json(
            "alloc", "create", "--name", "worker", "--gpus", "1", "--host-class", host_class,
            "--wait", "--timeout", "120",
        )  # fmt: skip
        assert worker["status"] == "active"
        # An ambiguous prefix names both candidates (short ids and names) instead of guessing.
        wid = worker["allocation_id"]
        common = aid[: next((i for i, (x, y) in enumerate(zip(aid, wid, strict=True)) if x != y), 0)]
        rc, _, err = await cli("alloc", "show", common or "0", ok=False)
        if common:
            assert rc == 1 and "ambiguous_reference" in err and "cli-test" in err and "worker" in err, err
        rc, _, err = await cli("alloc", "ssh", "no-such-allocation", ok=False)
        assert rc == 1 and "not_found" in err and "validation_error" not in err, err

        rc, out, err = await cli(
            "--json", "apps", "deploy", APP, "--name", "cli-cluster", "--controller", "cli-test",
            "--mode", "same_node", "-c", "cluster_name=cli", "--wait", "--timeout", "240", ok=False,
        )  # fmt: skip
        assert rc == 0, (out[-3000:], err[-3000:])
        inst = json.loads(out)
        iid = inst["instance_id"]
        assert inst["status"] == "running" and [m["allocation_id"] for m in inst["members"]] == [aid]
        assert inst["config"]["cluster_name"] == "cli"
        assert iid in [i["instance_id"] for i in await cli.json("apps", "status")]
        _, instances_table, _ = await cli("apps", "status")
        assert iid not in instances_table and iid[:8] in instances_table  # a short id
        op = await cli.json("apps", "add-worker", "cli-cluster", "worker")
        assert op["kind"] == "add" and op["status"] in ("pending", "claimed", "in_progress", "succeeded")

        async def members(want: int) -> Any:
            i = await cli.json("apps", "status", iid)
            live = [m for m in i["members"] if m["status"] == "active" and not m.get("tombstoned")]
            return i if len(live) == want and i["status"] == "running" else None

        i = await eventually(lambda: members(2), 180, "the worker added", interval_s=1)
        member = next(m for m in i["members"] if m["allocation_id"] == worker["allocation_id"])
        _, status_table, _ = await cli("apps", "status", "cli-cluster")
        member_short = next(w for w in status_table.split() if len(w) >= 8 and member["member_id"].startswith(w))
        op = await cli.json("apps", "remove-worker", "cli-cluster", member_short)
        assert op["kind"] == "remove"
        i = await eventually(lambda: members(1), 180, "the worker removed", interval_s=1)
        assert {o["kind"] for o in i["operations"] if o["status"] == "succeeded"} >= {"add", "remove"}
        _, status_table, _ = await cli("apps", "status", iid)
        assert "cli-cluster" in status_table and "Operations" in status_table and "running" in status_table
        # Not a launchable app: nothing to open in a browser, said plainly.
        rc, out, err = await cli("apps", "open", "cli-cluster", "--no-browser", ok=False)
        assert rc == 1 and "not_launchable" in err and "Traceback" not in err, err
        done = await cli.json("apps", "decommission", "cli-cluster", "--wait", "--timeout", "240")
        assert done["status"] == "decommissioned"

        # A problem+json answer is shown clearly: detail, stable code, HTTP status; exit 1, no traceback.
        rc, out, err = await cli("apps", "deploy", "no-such-app", "--name", "x", "--controller", aid, ok=False)
        assert rc == 1 and out == "" and "Traceback" not in err
        assert re.search(r"error: .+ \([a-z_]+, HTTP 4\d\d\)", err), err

        released = await cli.json("alloc", "release", aid, "--wait", "--timeout", "120")
        assert released["status"] == "released"
        assert (await cli.json("alloc", "release", worker["allocation_id"], "--wait"))["status"] == "released"

        apps = await cli.json("apps", "list")
        assert isinstance(apps, list)
        cost = await cli.json("cost")
        assert cost["period_start"] and [p["project_id"] for p in cost["projects"]] in ([], [pid])
        _, cost_table, _ = await cli("cost")
        assert "Period" in cost_table and "Per project" in cost_table

        # The daily series (the GPU price this test published: the released allocations are charged).
        async def charged() -> Any:
            daily = await cli.json("cost", "--by", "day")
            return daily if daily["days"] else None

        daily = await eventually(charged, 120, "charges of the released allocations", interval_s=2)
        cost = await cli.json("cost")
        assert sum(Decimal(d["amount"]) for d in daily["days"]) == Decimal(cost["totals"][0]["amount"]) > 0
        _, daily_table, _ = await cli("cost", "--by", "day")
        assert "Daily spend" in daily_table and daily["days"][0]["day"] in daily_table, daily_table
        assert MONEY.search(daily_table) and "Period total" in daily_table
        _, cost_table, _ = await cli("cost")
        assert MONEY.search(cost_table) and " cli " in cost_table  # the project by name, money with currency
        # Keys and volumes go away.
        await cli.json("keys", "delete", "laptop")
        assert await cli.json("keys", "list") == []
        tmp = await cli.json("volumes", "create", "tmp", "--size", "1", "--no-persist")
        assert tmp["persist"] is False and tmp["after_release"]
        assert (await cli.json("volumes", "delete", "tmp"))["deleted"] == tmp["volume_id"]
        left = {v["volume_id"]: v["status"] for v in await cli.json("volumes", "list")}
        assert left.get(tmp["volume_id"]) in (None, "deleted")
        _, vol_table, _ = await cli("volumes", "list")
        assert "data" in vol_table
        await cli("logout")
        assert json.loads((tmp_path / "config.json").read_text())["access_token"] is None
        rc, _, err = await cli("alloc", "list", ok=False)
        assert rc == 1 and "gpuaas login" in err
    finally:
        if controller is not None:
            stop_process(controller)
        stop_process(agent)


async def test_the_operator_login_make_run_prints_signs_in(stack: Stack, tmp_path: Path) -> None:
    """Issue 26: the seeded operator (`make run` prints its login) signs in with `gpuaas login` through the real
    discovery, and an address discovery refuses is an error that names the field and the reason."""
    email, password = stack.admin_login
    cli = Cli(stack, tmp_path / "config.json")
    _, out, _ = await cli("login", "--email", email, "--password", password)
    assert f"Signed in as {email}" in out, out
    me = await cli.json("whoami")
    assert me["email"] == email and any(m["role"] == "platform_admin" for m in me["memberships"]), me
    rc, _, err = await cli("login", "--email", "someone@corp.local", "--password", "x", ok=False)
    lines = err.splitlines()
    assert rc == 1 and lines[0] == "error: The request failed validation. (validation_error, HTTP 422)", err
    assert lines[1].startswith("  email (query): value is not a valid email address: "), err
