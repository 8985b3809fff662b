"""The web console in a real headless Chromium (Debian's `chromium`, driven by playwright-core) against the
whole suite as processes: the Python side prepares a tenant, a project admin, a host with a node-agent, the
seed catalog (pushed to a real OCI registry) and a running app controller; the Node script
(web/console/tests/console.e2e.mjs) then does, through the browser only: login (work tab discovery, inline
error, personal tab), session kept across reload, create an allocation and watch its live timeline reach
active, open the terminal and run a command, restart it and resize it (live timeline entries), grant a
project member SSH access, create a volume and attach it, browse the catalog, deploy an app through the
wizard (manifest inputs) and see it running, add a worker on a second allocation and remove it, decommission
the instance, release the allocation, see the cost appear, the narrow-screen layout, logout, the operator
pages, and create a budget and see it listed. On a stack with the runtime images (container driver), the
first allocation is created from a runtime picked in the form (gpuaas-scipy), and its page must show that
runtime, its digest, the driver and the limits, and after release the agent's release checks; the operator's
hosts page shows the host's driver and tenancy. Issue 21: the tenant sees no operator menu, the SSH grant picks
the member by name and email (the grant row shows the member, not a raw id), the deploy wizard shows the
app's runtime image, a non-launchable instance has no "Open" button, the operator's capacity page draws (its
charts are checked against the APIs in test_console_insight.py). Issue 29: a request for all the host's GPUs,
made while the first allocation holds two, waits `queued` and its page shows its position and the reason in
words, then it is cancelled; the operator's queue page shows the tenant's queue (its weight) and a chart of
the queues' shares with the GPUs the tenant held. Any console error fails it; every page is screenshotted.
(SSO from the console is in test_identity_sso.py, next to the enterprise IdP it needs.)"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import asyncssh
import httpx
import pytest

from gpuaas.devstack.golden_path.actors import start_agent
from gpuaas.devstack.infra import stop_process
from gpuaas.devstack.pytest_plugin import new_team, target_of
from gpuaas.devstack.registry import LocalRegistry
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CONSOLE = ROOT / "web" / "console"
CHROMIUM = os.environ.get("GPUAAS_CHROMIUM", "/usr/bin/chromium")
PASSWORD = "console-horse-battery"
APP = "slurm-reference"
RUNTIME_SLUG = "gpuaas-scipy"  # picked in the form: not the platform default (gpuaas-base)


def _newest(path: Path) -> float:
    return max((p.stat().st_mtime for p in path.rglob("*") if p.is_file()), default=0.0)


def ensure_console_built() -> None:
    """`make test` builds the console before the suite; a bare pytest run builds it here if it is stale."""
    if not (CONSOLE / "node_modules").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=CONSOLE, check=True, timeout=600)
    index = CONSOLE / "dist" / "index.html"
    sources = max(_newest(CONSOLE / "src"), (CONSOLE / "index.html").stat().st_mtime)
    if not index.exists() or index.stat().st_mtime < sources:
        subprocess.run(["npm", "run", "build"], cwd=CONSOLE, check=True, timeout=600)


def start_controller(stack: Stack, sa: dict, run: str) -> subprocess.Popen:
    """The e2e app controller (SDK only) as a process, with the project's service account."""
    env = {
        **os.environ,
        "GPUAAS_URL": stack.gateway_url,
        "GPUAAS_CLIENT_ID": sa["client_id"],
        "GPUAAS_CLIENT_SECRET": sa["client_secret"],
        "APP_SLUG": APP,
    }
    with open(stack.logs_dir / f"console-controller-{run}.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "e2e" / "app_runtime_controller.py")],
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )


async def console_served(stack: Stack, gw: httpx.AsyncClient) -> None:
    """Node, npm and Chromium are there, the console is built, and the gateway serves it at /."""
    for tool in ("node", "npm"):
        assert shutil.which(tool), f"{tool} is needed for the console (make install puts it there)"
    assert Path(CHROMIUM).exists(), f"Debian's chromium is needed at {CHROMIUM} (make install puts it there)"
    ensure_console_built()
    index = await gw.get("/")
    if 'id="app"' not in index.text:  # the gateway started before the console was built
        stack.stop("gateway")
        stack.start_service("gateway")
        index = await gw.get("/")
    assert 'id="app"' in index.text and index.headers["content-security-policy"].startswith("default-src 'self'")


async def run_browser(script: str, env: dict[str, str], timeout_s: float = 900) -> dict:
    """Run a browser script of web/console/tests; its result line, asserted ok and free of console errors."""
    proc = await asyncio.create_subprocess_exec(
        "node",
        f"tests/{script}",
        cwd=CONSOLE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "CHROMIUM": CHROMIUM, **env},
    )
    out, err = (b.decode() for b in await asyncio.wait_for(proc.communicate(), timeout_s))
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no result from the browser script (rc {proc.returncode}): {out[-3000:]} {err[-3000:]}"
    result = json.loads(lines[-1])
    failed = [s for s in result["steps"] if not s["ok"]]
    assert proc.returncode == 0 and result["ok"], (result.get("error"), failed, result["consoleErrors"])
    assert result["consoleErrors"] == []
    assert all(Path(p).stat().st_size > 5000 for p in result["screenshots"])
    return result


async def enable_app(
    gw: httpx.AsyncClient, registry: LocalRegistry, *, tid: str, pid: str, user: dict[str, str], run: str
) -> dict:
    """The seed catalog on a real registry, entitled to the tenant, and an app-controller service account
    of the project bound to the app by the project admin `user` (start it with `start_controller`)."""

    async def seeded() -> httpx.Response | None:  # the new tenant reaches catalog by event
        r = await gw.post("/api/catalog/admin/seed", json={"registry": registry.address, "tenant_ids": [tid]})
        return None if r.status_code == 422 and r.json()["code"] == "tenant_unknown" else r

    r = await eventually(seeded, 60, "catalog seeded for the tenant", interval_s=0.5)
    assert r.status_code == 200, r.text
    r = await gw.post("/api/catalog/entitlements", json={"tenant_id": tid, "app_slug": APP})
    assert r.status_code in (201, 409), r.text
    r = await gw.post(
        f"/api/identity/projects/{pid}/service-accounts", json={"name": f"ctl-{run}", "scopes": ["app-controller"]}
    )
    assert r.status_code == 201, r.text
    sa = r.json()

    async def bound() -> bool:  # app-runtime's projections have the service account and the app
        r = await gw.put(
            f"/api/app-runtime/projects/{pid}/controllers/{APP}",
            json={"service_account_id": sa["service_account_id"]},
            headers=user,
        )
        return r.status_code in (200, 201)

    await eventually(bound, 60, "controller bound", interval_s=0.5)
    return sa


@pytest.fixture(scope="module")
def registry():
    reg = LocalRegistry(Path(tempfile.mkdtemp(prefix="gpuaas-console-registry-"))).start()
    yield reg
    reg.stop()


async def test_console_in_a_real_browser(stack: Stack, gw: httpx.AsyncClient, registry: LocalRegistry) -> None:
    await console_served(stack, gw)
    # ada administers the project; bob, a second member, is whom the browser grants SSH access to an allocation.
    team = await new_team(gw, "web", "Web", "console", "ada", "bob", PASSWORD)
    run, tid, pid, email, colleague = team.run, team.tenant_id, team.project_id, team.admin_email, team.member_id
    colleague_key = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    # A price that makes a minute of one GPU visible.
    r = await gw.post(
        "/api/billing/prices",
        json={
            "unit": "gpu_hour",
            "unit_price": "360.00",
            "currency": "USD",
            "gpu_model": "L40S-48GB",
            "shape": "gpu_slice",
            "effective_from": "2020-01-01T00:00:00Z",
        },
    )
    assert r.status_code in (201, 409), r.text

    host_class = f"web-{run}"
    r = await gw.post("/api/allocations/hosts", json={"name": host_class, "host_class": host_class})
    assert r.status_code == 201, r.text
    host = r.json()
    agent = start_agent(target_of(stack), host["node_token"], host_class, "4xL40S-48GB")
    controller = None
    try:

        async def host_ready() -> bool:
            return (await gw.get(f"/api/allocations/hosts/{host['host_id']}")).json().get("status") == "ready"

        await eventually(host_ready, 60, "host ready")
        # A queue of the pool for the tenant (weight 2: what the operator's queue page must show).
        r = await gw.put(f"/api/allocations/tenants/{tid}/queues/L40S-48GB", json={"weight": 2})
        assert r.status_code == 200, r.text
        # With the runtime images (container driver) the browser picks a runtime other than the default.
        scipy = stack.runtimes.pushed.get(RUNTIME_SLUG)
        runtime_env = (
            {"RUNTIME": f"{RUNTIME_SLUG}@{scipy.version}", "RUNTIME_DIGEST": scipy.digest, "EXPECT_DRIVER": "container"}
            if scipy
            else {"EXPECT_DRIVER": "process"}
        )
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
            r = await c.post(
                "/api/identity/auth/token", data={"grant_type": "password", "username": email, "password": PASSWORD}
            )
            assert r.status_code == 200, r.text
            user = {"Authorization": f"Bearer {r.json()['access_token']}"}
            sa = await enable_app(gw, registry, tid=tid, pid=pid, user=user, run=run)

            async def projected() -> bool:  # every service knows the new project and the user's role
                checks = [
                    c.get(f"/api/allocations/projects/{pid}/allocations", headers=user),
                    c.get("/api/billing/costs", params={"project_id": pid}, headers=user),
                    c.get("/api/metering/meters", params={"project_id": pid}, headers=user),
                    c.get("/api/app-runtime/instances", params={"project_id": pid}, headers=user),
                    c.get("/api/catalog/apps", params={"tenant_id": tid}, headers=user),
                ]
                answers = [await a for a in checks]
                runtimes = await c.get("/api/allocations/runtimes", params={"project_id": pid}, headers=user)
                offered = {f"{r['slug']}@{r['version']}" for r in runtimes.json()} if runtimes.is_success else set()
                return (
                    all(a.status_code == 200 for a in answers)
                    and any(app["slug"] == APP for app in answers[-1].json())
                    and (not runtime_env or runtime_env["RUNTIME"] in offered)
                )

            await eventually(projected, 60, "the project in every service's projection", interval_s=0.5)
        controller = start_controller(stack, sa, run)
        shots = stack.root / "console-screenshots"
        admin_email, admin_password = stack.admin_login
        budget = f"console-budget-{run}"
        result = await run_browser(
            "console.e2e.mjs",
            {
                "GATEWAY_URL": stack.gateway_url,
                "USER_EMAIL": email,
                "USER_PASSWORD": PASSWORD,
                "ADMIN_EMAIL": admin_email,
                "ADMIN_PASSWORD": admin_password,
                "HOST_CLASS": host_class,
                "APP_SLUG": APP,
                "SCREENSHOT_DIR": str(shots),
                "GPU_MODEL": "L40S-48GB",
                "MEMBER_USER_ID": colleague,
                "MEMBER_PUBLIC_KEY": colleague_key,
                "BUDGET_NAME": budget,
                "TENANT_ID": tid,
                "HOST_GPUS": "4",
                **runtime_env,
            },
        )
        names = [s["name"] for s in result["steps"]]
        for name in (
            "browser terminal runs a command",
            "restart the allocation",
            "resize the allocation to 2 GPUs",
            "grant a project member SSH access",
            "create a volume and attach it",
            "add a worker",
            "remove the worker",
            "decommission the instance",
            "the cost appears",
            "budgets: create one and see it listed",
            "a request that does not fit waits: position and reason, then cancelled",
        ):
            assert name in names, name
        assert len(result["screenshots"]) >= 28
        if scipy:
            assert "the allocation shows its runtime, digest, driver and limits" in names
            assert result["runtimeShown"] == f"{RUNTIME_SLUG} {scipy.version}"
            row = await stack.fetch(
                "allocations",
                "SELECT runtime, driver, limits FROM allocations WHERE allocation_id = $1",
                uuid.UUID(result["allocation"]),
            )
            stored = {k: json.loads(v) if k != "driver" and isinstance(v, str) else v for k, v in dict(row[0]).items()}
            assert stored["runtime"]["digest"] == scipy.digest and stored["driver"] == "container", stored
            assert stored["limits"]["pids"] > 0
        # What the browser did is real: the allocation was released, the instance decommissioned, a charge exists.
        alloc = result["allocation"]
        sql = "SELECT status FROM allocations WHERE allocation_id = $1"
        assert await stack.fetchval("allocations", sql, uuid.UUID(alloc)) == "released"
        sql = "SELECT status FROM instances WHERE instance_id = $1"
        assert await stack.fetchval("app_runtime", sql, uuid.UUID(result["instance"])) == "decommissioned"
        r = await gw.get("/api/billing/charges", params={"project_id": pid, "allocation_id": alloc})
        assert r.status_code == 200 and r.json(), r.text
        # The queued request waited with its reason, got no GPUs and was cancelled; the chart drew the tenant.
        assert "position 1" in result["queueNotice"] and "no ready host" in result["queueNotice"], result
        sql = "SELECT status, host_id FROM allocations WHERE allocation_id = $1"
        (queued,) = await stack.fetch("allocations", sql, uuid.UUID(result["queued"]))
        assert (queued["status"], queued["host_id"]) == ("released", None), dict(queued)
        sql = "SELECT message FROM timeline WHERE allocation_id = $1 AND phase = 'queue' ORDER BY seq"
        messages = [m["message"] for m in await stack.fetch("allocations", sql, uuid.UUID(result["queued"]))]
        assert messages[0].startswith("waiting in the L40S-48GB queue") and "cancelled" in messages[-1], messages
        assert result["queueShares"], result
        # ... and so are the restart, the resize, the grant, the attachment, the worker and the budget.
        sql = "SELECT kind, status FROM agent_tasks WHERE allocation_id = $1"
        tasks = {(t["kind"], t["status"]) for t in await stack.fetch("allocations", sql, uuid.UUID(alloc))}
        assert {("restart", "succeeded"), ("resize", "succeeded")} <= tasks, tasks
        sql = "SELECT user_id, origin FROM ssh_grants WHERE allocation_id = $1 AND user_id = $2"
        assert len(await stack.fetch("allocations", sql, uuid.UUID(alloc), uuid.UUID(colleague))) == 1
        sql = "SELECT count(*) FROM volumes WHERE project_id = $1 AND name = 'scratch'"
        assert await stack.fetchval("allocations", sql, uuid.UUID(pid)) == 1
        assert result["mountPath"].startswith("/")
        sql = "SELECT kind, status FROM operations WHERE instance_id = $1"
        ops = {(o["kind"], o["status"]) for o in await stack.fetch("app_runtime", sql, uuid.UUID(result["instance"]))}
        assert {("add", "succeeded"), ("remove", "succeeded")} <= ops, ops
        sql = "SELECT tenant_id, limit_amount, currency FROM budgets WHERE name = $1"
        budgets = await stack.fetch("billing", sql, budget)
        assert len(budgets) == 1 and budgets[0]["limit_amount"] == 250 and budgets[0]["currency"] == "USD"
    finally:
        if controller is not None:
            stop_process(controller)
        stop_process(agent)
