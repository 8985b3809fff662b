"""The web console in a real headless Chromium (Debian's `chromium`, driven by playwright-core) against the
whole suite as processes: the Python side prepares a tenant, a project admin, a host with a node-agent, the
seed catalog (pushed to a real OCI registry) and a running app controller; the Node script
(web/console/tests/console.e2e.mjs) then does, through the browser only: login (work tab discovery, inline
error, personal tab), session kept across reload, create an allocation and watch its live timeline reach
active, open the terminal and run a command, browse the catalog, deploy an app through the wizard (manifest
inputs) and see it running, decommission it, release the allocation, see the cost appear, the narrow-screen
layout, logout, and the operator pages. Any console error fails it; every page is screenshotted."""

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

import httpx
import pytest

from gpuaas.catalog.testing import LocalRegistry
from gpuaas.devstack.stack import Stack

from .conftest import eventually
from .test_allocations_gateway import start_agent, stop_agent

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
CONSOLE = ROOT / "web" / "console"
CHROMIUM = os.environ.get("GPUAAS_CHROMIUM", "/usr/bin/chromium")
PASSWORD = "console-horse-battery"
APP = "slurm-reference"


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


@pytest.fixture(scope="module")
def registry():
    reg = LocalRegistry(Path(tempfile.mkdtemp(prefix="gpuaas-console-registry-"))).start()
    yield reg
    reg.stop()


async def test_console_in_a_real_browser(stack: Stack, gw: httpx.AsyncClient, registry: LocalRegistry) -> None:
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

    run = uuid.uuid4().hex[:6]
    r = await gw.post("/api/identity/tenants", json={"slug": f"web-{run}", "name": f"Web {run}"})
    assert r.status_code == 201, r.text
    tid = r.json()["tenant_id"]
    r = await gw.post(f"/api/identity/tenants/{tid}/projects", json={"name": "console"})
    assert r.status_code == 201, r.text
    pid = r.json()["project_id"]
    email = f"ada-{run}@web-{run}.example.com"
    r = await gw.post(f"/api/identity/tenants/{tid}/users", json={"email": email, "password": PASSWORD, "role": None})
    assert r.status_code == 201, r.text
    member = {"user_id": r.json()["user_id"], "role": "project_admin"}
    r = await gw.post(f"/api/identity/projects/{pid}/members", json=member)
    assert r.status_code == 201, r.text
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
    # The seed catalog on a real registry, entitled to this tenant.
    r = await gw.post("/api/catalog/admin/seed", json={"registry": registry.address, "tenant_ids": [tid]})
    assert r.status_code == 200, r.text
    r = await gw.post("/api/catalog/entitlements", json={"tenant_id": tid, "app_slug": APP})
    assert r.status_code in (201, 409), r.text
    r = await gw.post(
        f"/api/identity/projects/{pid}/service-accounts", json={"name": f"ctl-{run}", "scopes": ["app-controller"]}
    )
    assert r.status_code == 201, r.text
    sa = r.json()

    host_class = f"web-{run}"
    r = await gw.post("/api/allocations/hosts", json={"name": host_class, "host_class": host_class})
    assert r.status_code == 201, r.text
    host = r.json()
    agent = start_agent(stack, host["node_token"], host_class, "2xL40S-48GB")
    controller = None
    try:

        async def host_ready() -> bool:
            return (await gw.get(f"/api/allocations/hosts/{host['host_id']}")).json().get("status") == "ready"

        await eventually(host_ready, 60, "host ready")
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
            r = await c.post(
                "/api/identity/auth/token", data={"grant_type": "password", "username": email, "password": PASSWORD}
            )
            assert r.status_code == 200, r.text
            user = {"Authorization": f"Bearer {r.json()['access_token']}"}

            async def bound() -> bool:  # app-runtime's projections have the service account and the app
                r = await c.put(
                    f"/api/app-runtime/projects/{pid}/controllers/{APP}",
                    json={"service_account_id": sa["service_account_id"]},
                    headers=user,
                )
                return r.status_code in (200, 201)

            await eventually(bound, 60, "controller bound", interval_s=0.5)

            async def projected() -> bool:  # every service knows the new project and the user's role
                checks = [
                    c.get(f"/api/allocations/projects/{pid}/allocations", headers=user),
                    c.get("/api/billing/costs", params={"project_id": pid}, headers=user),
                    c.get("/api/metering/meters", params={"project_id": pid}, headers=user),
                    c.get("/api/app-runtime/instances", params={"project_id": pid}, headers=user),
                    c.get("/api/catalog/apps", params={"tenant_id": tid}, headers=user),
                ]
                answers = [await a for a in checks]
                return all(a.status_code == 200 for a in answers) and any(
                    app["slug"] == APP for app in answers[-1].json()
                )

            await eventually(projected, 60, "the project in every service's projection", interval_s=0.5)
        controller = start_controller(stack, sa, run)
        shots = stack.root / "console-screenshots"
        admin_email, admin_password = stack.admin_login
        proc = await asyncio.create_subprocess_exec(
            "node",
            "tests/console.e2e.mjs",
            cwd=CONSOLE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={
                **os.environ,
                "GATEWAY_URL": stack.gateway_url,
                "USER_EMAIL": email,
                "USER_PASSWORD": PASSWORD,
                "ADMIN_EMAIL": admin_email,
                "ADMIN_PASSWORD": admin_password,
                "HOST_CLASS": host_class,
                "APP_SLUG": APP,
                "SCREENSHOT_DIR": str(shots),
                "CHROMIUM": CHROMIUM,
                "GPU_MODEL": "L40S-48GB",
            },
        )
        out, err = (b.decode() for b in await asyncio.wait_for(proc.communicate(), 900))
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert lines, f"no result from the browser script (rc {proc.returncode}): {out[-3000:]} {err[-3000:]}"
        result = json.loads(lines[-1])
        failed = [s for s in result["steps"] if not s["ok"]]
        assert proc.returncode == 0 and result["ok"], (result.get("error"), failed, result["consoleErrors"])
        assert result["consoleErrors"] == []
        names = [s["name"] for s in result["steps"]]
        assert "browser terminal runs a command" in names and "the cost appears" in names
        assert len(result["screenshots"]) >= 20 and all(Path(p).stat().st_size > 5000 for p in result["screenshots"])
        # What the browser did is real: the allocation was released, the instance decommissioned, a charge exists.
        alloc = result["allocation"]
        sql = "SELECT status FROM allocations WHERE allocation_id = $1"
        assert await stack.fetchval("allocations", sql, uuid.UUID(alloc)) == "released"
        sql = "SELECT status FROM instances WHERE instance_id = $1"
        assert await stack.fetchval("app_runtime", sql, uuid.UUID(result["instance"])) == "decommissioned"
        r = await gw.get("/api/billing/charges", params={"project_id": pid, "allocation_id": alloc})
        assert r.status_code == 200 and r.json(), r.text
    finally:
        if controller is not None:
            stop_agent(controller)
        stop_agent(agent)
