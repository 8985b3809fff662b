"""The golden path's scenario, step by step (see the package doc)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncssh

from gpuaas.devstack.golden_path.actors import (
    Actor,
    Steps,
    Target,
    can_ssh,
    cannot_run_slurm,
    cluster_processes,
    instance_operations,
    reap,
    ssh,
    start_agent,
    unaudited_actions,
)
from gpuaas.devstack.infra import stop_process
from gpuaas.devstack.waiting import eventually
from gpuaas.sdk import ApiError
from gpuaas.sdk.models import PlacementIntent

PASSWORD = "correct-horse-battery"
APP = "slurm-reference"
GPU_PRICE = Decimal("3.60")  # per GPU-hour: a second of one GPU costs 0.001
JOB_PRICE = Decimal("0.05")  # per completed Slurm job (app usage unit `requests`)


async def golden_path(stack: Target, registry_address: str) -> list[dict[str, Any]]:
    """Run the whole scenario; returns the step timings. Raises AssertionError at the first step that fails."""
    # Container hosts (the stack's agents run the container driver): every allocation is a container of the
    # gpuaas-slurm runtime on its project's network, and the Slurm daemons run as root inside it (the
    # allocation user's sudo). Otherwise (no podman, or GPUAAS_GOLDEN_PATH_DRIVER=process) the hosts run the
    # process driver and the daemons run on this machine (Debian's Slurm installed by `make install`).
    driver = os.environ.get("GPUAAS_GOLDEN_PATH_DRIVER") or stack.agent_env.get("GPUAAS_AGENT_DRIVER") or "process"
    containers = driver == "container"
    reason = cannot_run_slurm(containers)
    if reason:
        raise RuntimeError(reason)

    def slow(timeout_s: float) -> float:
        """Waits on Slurm operations: every node action is an SSH session, which on a container host is a
        `podman exec` (0.15 s on an idle machine, 2.5-3 s measured with the 2-core machine at load 25-45)."""
        return timeout_s * (2 if containers else 1)

    async def node_ssh(endpoint: dict[str, Any], key: asyncssh.SSHKey, command: str) -> str:
        """A Slurm command on an allocation over SSH, as root there (the allocation user's sudo in a container)."""
        return await ssh(endpoint, key, f"sudo -n bash -c {shlex.quote(command)}" if containers else command)

    steps = Steps()
    run = uuid.uuid4().hex[:6]
    model = f"GP{run.upper()}-80GB"  # this run's hosts only
    started = datetime.now(UTC) - timedelta(seconds=5)
    procs: list[subprocess.Popen] = []
    iid = ""
    users: list[Actor] = []
    op = Actor(stack.gateway_url, "operator")
    users.append(op)
    await op.login(*stack.admin_login)
    try:
        # ---------------------------------------------------------------- 1. operator
        steps.start("1 operator: tenant, tenant admin, hosts, prices, catalog")
        tenant = await op.act("POST", "/api/identity/tenants", json={"slug": f"acme-{run}", "name": "Acme HPC"})
        tid = tenant["tenant_id"]
        admin_email = f"admin-{run}@acme.example.com"
        await op.act(
            "POST",
            f"/api/identity/tenants/{tid}/users",
            json={"email": admin_email, "password": PASSWORD, "role": "tenant_admin"},
        )
        hosts = []
        # Slurm's daemons run in the allocations and `srun -N2` spans two of them on two hosts: on container
        # hosts the two allocations reach each other on their project's network (both hosts' agents share
        # this machine's podman, so the network is one bridge).
        base = {"GPUAAS_AGENT_DRIVER": driver}
        for i, extra in ((1, base), (2, {**base, "GPUAAS_AGENT_INJECT_FAILURES": "release:1"})):
            h = await op.act("POST", "/api/allocations/hosts", json={"name": f"gp-{run}-{i}"})
            procs.append(start_agent(stack, h["node_token"], f"gp-{run}-{i}", f"1x{model}", **extra))
            hosts.append(h["host_id"])
        for hid in hosts:

            async def ready(hid: str = hid) -> bool:
                return (await op.get(f"/api/allocations/hosts/{hid}"))["status"] == "ready"

            await eventually(ready, 60, "host ready", interval_s=0.5)
        since = (datetime.now(UTC) - timedelta(days=1)).isoformat()
        gpu_sku = {"unit": "gpu_hour", "gpu_model": model, "shape": "gpu_slice"}
        for body in (gpu_sku, {"unit": "requests", "app_slug": APP}):
            try:
                await op.act(
                    "POST",
                    "/api/billing/prices",
                    json={
                        **body,
                        "unit_price": str(GPU_PRICE if body is gpu_sku else JOB_PRICE),
                        "currency": "USD",
                        "effective_from": since,
                    },
                )
            except ApiError as exc:  # the app's price from an earlier run in this stack
                assert exc.status == 409, exc.problem

        async def seeded() -> Any:
            try:
                return await op.act(
                    "POST", "/api/catalog/admin/seed", json={"registry": registry_address, "tenant_ids": [tid]}
                )
            except ApiError as exc:  # catalog's projection has not seen the new tenant yet
                assert exc.status in (404, 409, 422), exc.problem
                return None

        await eventually(seeded, 60, "catalog seeded and entitled", interval_s=1)
        apps = await op.get("/api/catalog/apps")
        slurm = next(a for a in (apps["items"] if isinstance(apps, dict) else apps) if a["slug"] == APP)
        assert slurm["version"] == "1.0.0" and slurm["runtime_version"] == "Slurm 22.05"

        # ---------------------------------------------------------------- 2. tenant admin
        steps.start("2 tenant admin: project, members, controller service account")
        alice = Actor(stack.gateway_url, "tenant-admin")
        users.append(alice)
        await alice.login(admin_email, PASSWORD)
        pid = (await alice.act("POST", f"/api/identity/tenants/{tid}/projects", json={"name": "hpc"}))["project_id"]
        member_ids = {}
        for who in ("bob", "carol"):
            email = f"{who}-{run}@acme.example.com"
            u = await alice.act(
                "POST", f"/api/identity/tenants/{tid}/users", json={"email": email, "password": PASSWORD, "role": None}
            )
            await alice.act(
                "POST",
                f"/api/identity/projects/{pid}/members",
                json={"user_id": u["user_id"], "role": "project_member"},
            )
            member_ids[who] = u["user_id"]
        sa = await alice.act(
            "POST",
            f"/api/identity/projects/{pid}/service-accounts",
            json={"name": "slurm-ctl", "scopes": ["app-controller"]},
        )

        async def bound() -> bool:
            try:
                await alice.act(
                    "PUT",
                    f"/api/app-runtime/projects/{pid}/controllers/{APP}",
                    json={"service_account_id": sa["service_account_id"]},
                )
                return True
            except ApiError as exc:
                # app_not_found: app-runtime's projection of the catalog's manifests is catching up
                assert exc.code in ("service_account_invalid", "project_not_found", "not_found", "app_not_found"), (
                    exc.problem
                )
                return False

        await eventually(bound, 60, "controller bound", interval_s=0.5)
        log = open(stack.logs_dir / f"slurm-reference-{run}.log", "ab")  # noqa: SIM115, ASYNC230 - handed to the child
        procs.append(
            subprocess.Popen(  # noqa: ASYNC220 - starting, not waiting
                [sys.executable, "-m", "gpuaas.slurm_reference"],
                env={
                    **os.environ,
                    "GPUAAS_URL": stack.gateway_url,
                    "GPUAAS_CLIENT_ID": sa["client_id"],
                    "GPUAAS_CLIENT_SECRET": sa["client_secret"],
                    "GPUAAS_APP_SLUG": APP,
                    "GPUAAS_LEASE_S": "30",
                    "GPUAAS_POLL_S": "0.5",
                    "GPUAAS_HEALTH_EVERY_S": "3",
                },
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        )

        # ---------------------------------------------------------------- 3. member: key, allocations, SSH, grant
        steps.start("3 member: SSH key, two allocations active, SSH, grant")
        bob, carol = Actor(stack.gateway_url, "bob"), Actor(stack.gateway_url, "carol")
        users += [bob, carol]
        await bob.login(f"bob-{run}@acme.example.com", PASSWORD)
        await carol.login(f"carol-{run}@acme.example.com", PASSWORD)
        bob_key, carol_key = asyncssh.generate_private_key("ssh-ed25519"), asyncssh.generate_private_key("ssh-ed25519")
        await bob.act(
            "POST",
            "/api/allocations/ssh-keys",
            json={"name": "laptop", "public_key": bob_key.export_public_key().decode()},
        )
        allocs: list[str] = []
        runtime = {"runtime": "gpuaas-slurm"} if containers else {}
        for name in ("a", "b"):

            async def create(name: str = name) -> str | None:
                try:
                    a = await bob.act(
                        "POST",
                        f"/api/allocations/projects/{pid}/allocations",
                        json={"gpu_model": model, "gpu_count": 1, "name": name, **runtime},
                    )
                except ApiError as exc:  # allocations' projection has not seen the project or member yet
                    assert exc.status in (403, 404, 409, 422), exc.problem
                    return None
                return str(a["allocation_id"])

            allocs.append(await eventually(create, 60, "allocation created", interval_s=0.5))
        a_id, b_id = allocs
        for aid in allocs:

            async def active(aid: str = aid) -> bool:
                return (await bob.get(f"/api/allocations/allocations/{aid}"))["status"] == "active"

            await eventually(active, 90, "allocation active", interval_s=0.5)
            timeline = await bob.get(f"/api/allocations/allocations/{aid}/timeline")
            moves = [e["message"] for e in sorted(timeline, key=lambda e: e["seq"]) if e["phase"] == "status"]
            assert moves[0] == "requested" and moves[-1].endswith("→ active"), timeline
        ep_a = (await bob.get(f"/api/allocations/allocations/{a_id}"))["ssh_endpoint"]
        ep_b = (await bob.get(f"/api/allocations/allocations/{b_id}"))["ssh_endpoint"]
        if containers:  # both on the project's network, each with its own address (what the controller uses)
            net_a, net_b = [(await bob.get(f"/api/allocations/allocations/{x}"))["network"] for x in (a_id, b_id)]
            assert net_a and net_b and net_a["name"] == net_b["name"], (net_a, net_b)
            assert net_a["address"] and net_b["address"] and net_a["address"] != net_b["address"], (net_a, net_b)
        assert (await bob.get(f"/api/allocations/allocations/{a_id}"))["host_id"] != (
            await bob.get(f"/api/allocations/allocations/{b_id}")
        )["host_id"]
        await eventually(lambda: can_ssh(ep_a, bob_key), 30, "bob's SSH to A", interval_s=0.5)
        assert not await can_ssh(ep_a, carol_key)
        await bob.act(
            "POST",
            f"/api/allocations/allocations/{a_id}/ssh-grants",
            json={"user_id": member_ids["carol"], "public_key": carol_key.export_public_key().decode()},
        )
        await eventually(lambda: can_ssh(ep_a, carol_key), 30, "carol's SSH to A through the grant", interval_s=0.5)

        # ---------------------------------------------------------------- 4. Slurm
        steps.start("4a deploy Slurm into A (controller + worker) → running")

        async def deploy() -> Any:
            try:
                return await alice.act(
                    "POST",
                    f"/api/app-runtime/projects/{pid}/instances",
                    json={
                        "name": "hpc",
                        "app_slug": APP,
                        "config": {"cluster_name": "acme", "partition": "gpu"},
                        "placement_intent": PlacementIntent(
                            mode="same_node",
                            controller_allocation_id=uuid.UUID(a_id),
                            worker_allocation_ids=[uuid.UUID(a_id)],
                        ).model_dump(mode="json"),
                    },
                )
            except ApiError as exc:  # app-runtime's projections catch up with catalog and allocations
                assert exc.status in (403, 404, 409, 422), exc.problem
                assert exc.code not in ("invalid_config", "placement_invalid"), exc.problem
                return None

        inst = await eventually(deploy, 60, "deploy accepted", interval_s=0.5)
        iid = inst["instance_id"]

        async def instance() -> dict[str, Any]:
            return await alice.get(f"/api/app-runtime/instances/{iid}")

        async def healthy_running() -> bool:
            i = await instance()
            assert i["status"] not in ("failed", "degraded"), (
                i["status"],
                i.get("failure_reason"),
                await instance_operations(alice, iid),
            )
            return i["status"] == "running" and i["health"]["status"] == "healthy"

        await eventually(healthy_running, slow(150), "instance running and healthy", interval_s=1)
        detail = (await instance())["runtime_detail"]
        access = detail["access"]
        assert access["versions"]["app_version"] == "1.0.0"
        assert access["versions"]["slurmctld"].startswith("22.05"), access["versions"]
        assert detail["runtime_version"].startswith("Slurm 22.05")
        assert {"sinfo", "srun", "sbatch", "sacct"} <= set(access["commands"])
        env = f"export SLURM_CONF={access['env']['SLURM_CONF']}; "

        steps.start("4b sinfo idle, sbatch → COMPLETED over SSH")
        (node_a,) = [n["name"] for n in detail["nodes"]]
        out = await node_ssh(ep_a, bob_key, env + "sinfo -h -N -o '%N %T'")
        assert out.split() == [node_a, "idle"], out
        job = (await node_ssh(ep_a, bob_key, env + "sbatch --parsable -o /dev/null --wrap 'hostname; sleep 1'")).strip()

        async def completed() -> bool:
            st = await node_ssh(ep_a, bob_key, env + f"sacct -n -X -P -j {job} -o State,Account")
            assert "PENDING" not in st or "InvalidAccount" not in st, st
            return st.startswith("COMPLETED")

        await eventually(completed, slow(60), "sbatch job COMPLETED", interval_s=1)

        steps.start("4c add worker on B → srun -N2 on both")
        await alice.act(
            "POST", f"/api/app-runtime/instances/{iid}/operations", json={"kind": "add", "allocation_id": b_id}
        )

        async def members(n: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                ms = await alice.get(f"/api/app-runtime/instances/{iid}/members")
                ms = ms["items"] if isinstance(ms, dict) else ms
                assert not any(m["status"] == "failed" for m in ms), await instance_operations(alice, iid)
                return len(ms) == n and all(m["status"] == "active" for m in ms)

            return check

        async def wait_members(n: int, timeout_s: float, what: str) -> None:
            """Until n members are active; on a timeout the operations (with their progress) say where it stuck."""
            try:
                await eventually(await members(n), timeout_s, what, interval_s=1)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; operations: {await instance_operations(alice, iid)}") from None

        await wait_members(3, slow(120), "worker B active")
        nodes = await node_ssh(ep_a, bob_key, env + "srun -N2 bash -c 'echo $SLURMD_NODENAME' | sort")
        names = nodes.split()
        assert len(names) == 2 and node_a in names, nodes
        node_b = next(n for n in names if n != node_a)

        async def member_on(allocation_id: str) -> dict[str, Any]:
            ms = await alice.get(f"/api/app-runtime/instances/{iid}/members")
            return next(m for m in (ms["items"] if isinstance(ms, dict) else ms) if m["allocation_id"] == allocation_id)

        steps.start("4c' slurmd on B dies → node DOWN, member failed, degraded; recover → running")

        async def degraded() -> bool:
            return (await instance())["status"] == "degraded"

        async def recovered() -> bool:
            i = await instance()
            return i["status"] == "running" and i["health"]["status"] == "healthy"

        cid = "c" + uuid.UUID(iid).hex[:12]
        dir_b = f"/var/lib/gpuaas-slurm/{b_id.replace('-', '')[-12:]}/{cid}"
        await node_ssh(ep_b, bob_key, f"kill -9 $(cat {dir_b}/run/slurmd-{node_b}.pid)")
        await eventually(degraded, slow(90), "the controller reporting node B's member failed", interval_s=1)
        down = await member_on(b_id)
        assert down["status"] == "failed" and down["detail"]["slurm_state"].startswith("down"), down
        recover = {"kind": "recover", "member_id": down["member_id"]}
        await alice.act("POST", f"/api/app-runtime/instances/{iid}/operations", json=recover)
        await eventually(recovered, slow(120), "recovered from the down node", interval_s=1)
        names = (await node_ssh(ep_a, bob_key, env + "srun -N2 bash -c 'echo $SLURMD_NODENAME' | sort")).split()
        assert len(names) == 2 and node_a in names and node_b not in names, names
        node_b = next(n for n in names if n != node_a)

        steps.start("4d drain worker B, then remove it (slurmctld restarted, verified teardown)")
        w_b = await member_on(b_id)
        await alice.act(
            "POST",
            f"/api/app-runtime/instances/{iid}/operations",
            json={"kind": "drain", "member_id": w_b["member_id"]},
        )

        async def drained() -> bool:
            return (await member_on(b_id))["status"] == "stopped"

        await eventually(drained, slow(60), "worker B drained", interval_s=1)
        state = await node_ssh(ep_a, bob_key, env + f"sinfo -h -N -n {node_b} -o '%T'")
        assert state.strip() in ("drained", "draining"), state
        await alice.act(
            "POST",
            f"/api/app-runtime/instances/{iid}/operations",
            json={"kind": "remove", "member_id": w_b["member_id"]},
        )
        await wait_members(2, slow(120), "worker B removed")
        removal = next(o for o in await instance_operations(alice, iid) if o["kind"] == "remove")
        assert removal["result"]["teardown_verified"] is True, removal
        assert (await node_ssh(ep_a, bob_key, env + "sinfo -h -N -o '%N'")).split() == [node_a]
        assert node_b not in await node_ssh(ep_b, bob_key, "ps -eo args")

        steps.start("4e re-add worker B: bootstrap fails on a broken host dir (clear reason), recover → srun -N2")
        broken = dir_b
        # a file where a dir goes
        await node_ssh(ep_b, bob_key, f"mkdir -p $(dirname {broken}) && echo broken > {broken}")
        await alice.act(
            "POST", f"/api/app-runtime/instances/{iid}/operations", json={"kind": "add", "allocation_id": b_id}
        )

        await eventually(degraded, slow(60), "instance degraded by the failed worker", interval_s=1)
        bad = await member_on(b_id)
        failed_add = next(
            o
            for o in await instance_operations(alice, iid)
            if o.get("result_member_id") == bad["member_id"] or o.get("member_id") == bad["member_id"]
        )
        assert bad["status"] == "failed" and "cannot create the cluster directory" in (failed_add["error"] or ""), (
            failed_add
        )
        await node_ssh(ep_b, bob_key, f"rm -f {broken}")
        await alice.act(
            "POST",
            f"/api/app-runtime/instances/{iid}/operations",
            json={"kind": "recover", "member_id": bad["member_id"]},
        )

        await eventually(recovered, slow(120), "recovered: running", interval_s=1)
        await wait_members(3, slow(30), "recovered worker active")
        tombs = await alice.get(f"/api/app-runtime/instances/{iid}/members", include_tombstones="true")
        tomb = next(m for m in tombs["items"] if m["member_id"] == bad["member_id"])
        assert tomb["tombstoned"] and tomb["status"] == "failed", tomb
        nodes = await node_ssh(ep_a, bob_key, env + "srun -N2 bash -c 'echo $SLURMD_NODENAME' | sort")
        assert len(nodes.split()) == 2 and node_a in nodes.split() and node_b not in nodes.split(), nodes
        w_b = await member_on(b_id)
        await alice.act(
            "POST",
            f"/api/app-runtime/instances/{iid}/operations",
            json={"kind": "remove", "member_id": w_b["member_id"]},
        )
        await wait_members(2, slow(120), "recovered worker B removed")

        # ---------------------------------------------------------------- 5. metering and billing
        steps.start("5 metering: GPU time on both allocations, app usage charged once")
        for aid in allocs:
            meter = await op.get(f"/api/metering/meters/{aid}")
            assert meter["status"] == "open", meter

        async def app_usage_charged() -> bool:
            charges = await alice.get("/api/billing/charges", project_id=pid, instance_id=iid)
            return any(c["unit"] == "requests" for c in charges)

        await eventually(app_usage_charged, 60, "the controller's app usage (completed jobs) charged", interval_s=1)

        # ---------------------------------------------------------------- 6. decommission, release
        steps.start("6a decommission → verified teardown")
        await alice.act("POST", f"/api/app-runtime/instances/{iid}/decommission", json={"reason": "golden path done"})

        async def decommissioned() -> bool:
            i = await instance()
            assert i["status"] != "decommission_failed", i["decommission"]
            return i["status"] == "decommissioned"

        await eventually(decommissioned, slow(120), "decommissioned", interval_s=1)
        report = (await instance())["decommission"]
        assert not report["forced"] and len(report["verified_member_ids"]) >= 2, report
        assert any("removed" in e for e in report["evidence"]), report
        assert cluster_processes(cid) == [], "daemons left after a verified teardown"
        left = await node_ssh(ep_a, bob_key, f"ls /var/lib/gpuaas-slurm/*/{cid} 2>&1 || true")
        assert "No such file" in left, left

        steps.start("6b release both; one release fails on purpose, then retry")
        for aid in allocs:
            await bob.act("POST", f"/api/allocations/allocations/{aid}/release")
        failed: dict[str, Any] = {}

        async def settled() -> bool:
            states = {aid: await bob.get(f"/api/allocations/allocations/{aid}") for aid in allocs}
            failed.update({k: v for k, v in states.items() if v["status"] == "release_failed"})
            return all(v["status"] in ("released", "release_failed") for v in states.values())

        await eventually(settled, 90, "both releases settled", interval_s=0.5)
        assert len(failed) == 1, failed
        (bad_id, bad) = next(iter(failed.items()))
        assert bad.get("failure_reason") or bad.get("release_failure_reason"), bad
        await bob.act("POST", f"/api/allocations/allocations/{bad_id}/retry-release")

        async def released() -> bool:
            states = [(await bob.get(f"/api/allocations/allocations/{a}"))["status"] for a in allocs]
            return states == ["released", "released"]

        await eventually(released, 90, "retried release done", interval_s=0.5)

        steps.start("5/6c GPU time charged for both allocations; billing stopped; costs agree")

        async def gpu_charged() -> dict[str, list[dict[str, Any]]] | None:
            out = {}
            for aid in allocs:
                meter = await op.get(f"/api/metering/meters/{aid}")
                if meter["status"] != "closed":
                    return None
                charges = await alice.get("/api/billing/charges", project_id=pid, allocation_id=aid)
                records = await op.get(f"/api/metering/meters/{aid}/usage")
                if not charges or len(charges) != len(records):
                    return None
                out[aid] = charges
            return out

        gpu = await eventually(gpu_charged, 90, "GPU usage of both allocations charged", interval_s=1)
        for charges in gpu.values():
            assert all(c["unit"] == "gpu_hour" and Decimal(c["quantity"]) > 0 for c in charges), charges
        await asyncio.sleep(6)  # the window closer runs every 5 s: nothing may accrue after release
        every = await alice.get("/api/billing/charges", project_id=pid, limit=1000)
        assert sum(len(v) for v in gpu.values()) == sum(1 for c in every if c["unit"] == "gpu_hour")
        ids = [c["usage_record_id"] for c in every]
        assert len(ids) == len(set(ids)), "a usage record was charged twice"
        costs = await alice.get("/api/billing/costs", tenant_id=tid)
        (total,) = costs["totals"]
        assert Decimal(total["amount"]) == sum(Decimal(c["amount"]) for c in every) > 0
        assert Decimal(total["app_amount"]) == sum(Decimal(c["amount"]) for c in every if c["unit"] == "requests") > 0
        breakdown = await op.get("/api/billing/costs/breakdown", tenant_id=tid)
        assert sum(Decimal(r["amount"]) for r in breakdown) == Decimal(total["amount"])
        assert {r["sku"] for r in breakdown} and any(r["app_slug"] == APP for r in breakdown), breakdown

        # ---------------------------------------------------------------- 7. audit
        steps.start("7 audit: every user action under its own correlation id")
        actions = [a for u in users for a in u.actions]

        async def audited() -> list[str] | None:
            records: list[dict[str, Any]] = []
            offset = 0
            while True:
                page = await op.get("/api/identity/audit", since=started.isoformat(), limit=1000, offset=offset)
                items = page["items"] if isinstance(page, dict) else page
                records += items
                if len(items) < 1000:
                    break
                offset += 1000
            seen = {r.get("correlation_id") for r in records}
            missing = [f"{m} {p}" for cid, m, p in actions if cid not in seen]
            return None if missing else [r["action"] for r in records]

        try:
            recorded = await eventually(audited, 60, "every user action in the audit store", interval_s=1)
        except AssertionError:
            missing = await unaudited_actions(op, started, actions)
            raise AssertionError(
                f"user actions without an audit record under their correlation id: {missing}"
            ) from None
        for wanted in ("allocations.create", "apps.instance.deploy", "apps.instance.decommission"):
            assert any(wanted in a for a in recorded), (wanted, sorted(set(recorded)))
        steps.finish()
    finally:
        for p in reversed(procs):
            stop_process(p)
        if iid:  # a failed run must not leave its Slurm daemons behind (a passing run has none left)
            cid = "c" + uuid.UUID(iid).hex[:12]
            reap(cluster_processes(cid))
            for d in Path("/var/lib/gpuaas-slurm").glob(f"*/{cid}"):
                shutil.rmtree(d, ignore_errors=True)
                with contextlib.suppress(OSError):
                    d.parent.rmdir()  # the allocation's directory, when no other cluster uses it
        for u in users:
            await u.client.aclose()
        total_s = round(time.monotonic() - steps.t0, 1)
        (stack.root / "golden-path.json").write_text(json.dumps({"total_s": total_s, "steps": steps.done}, indent=1))
        print(f"\n[golden path] total {total_s}s: " + json.dumps(steps.done), flush=True)
    return steps.done
