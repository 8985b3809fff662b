"""JupyterLab, a launchable app, end to end through the stack (issue 21): the real `jupyter` app (the
`gpuaas-jupyter` image built from PyPI, pushed to the stack's registry and promoted through the catalog's
gates by the devstack) is deployed from the catalog; the deploy creates its allocation on a container host
and the node agent starts JupyterLab in the allocation's container; the instance is `running` only once the
health check answered. Then, through the gateway's `/apps/{instance_id}/` only:

- a real headless Chromium opens it with the signed-in user's token (no Jupyter token) — sent on to the app's
  own origin, `<instance>.apps.localhost`, where the console's session is out of the page's reach — creates a
  notebook and runs a cell whose output it reads back (web/console/tests/jupyter.e2e.mjs);
- the proxy's access rules: no token 401, a user of another tenant 404, a project viewer 403, the
  workload's own port without the platform's secret refused (403), the secret never reaches the browser;
- a project member's open kernel WebSocket is closed (4404: the instance is hidden from a non-member) when
  the membership is revoked, and the member's next request is refused (404);
- metering records the instance's app-hours (unit `app_hour`) once per window; decommission releases the
  allocation.
Needs the runtime images (podman, mmdebstrap, PyPI at build time): skipped where podman or the registry is not
installed, failed where they are and the images could not be built or pushed.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from urllib.parse import urlsplit

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from gpuaas.devstack.config import APPS_DOMAIN
from gpuaas.devstack.golden_path.actors import start_agent
from gpuaas.devstack.infra import stop_process
from gpuaas.devstack.pytest_plugin import new_team, target_of
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually
from tests.e2e.test_console import console_served, run_browser

pytestmark = pytest.mark.e2e

PASSWORD = "jupyter-horse-battery"
GPU_MODEL = "A2-16GB"  # declared by this test's own host only


async def _login(stack: Stack, email: str) -> str:
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        r = await c.post(
            "/api/identity/auth/token", data={"grant_type": "password", "username": email, "password": PASSWORD}
        )
        assert r.status_code == 200, r.text
        return str(r.json()["access_token"])


async def _user(gw: httpx.AsyncClient, tenant_id: str, email: str) -> str:
    r = await gw.post(
        f"/api/identity/tenants/{tenant_id}/users", json={"email": email, "password": PASSWORD, "role": None}
    )
    assert r.status_code == 201, r.text
    return str(r.json()["user_id"])


async def test_jupyterlab_through_the_gateway(stack: Stack, gw: httpx.AsyncClient) -> None:
    if not stack.runtimes.enabled:
        pytest.skip("podman or docker-registry is not installed: the stack runs no registry")
    # With the tools there, the images must be there: a failed build or push fails the test.
    assert await asyncio.to_thread(stack.runtimes.wait), f"the runtime images failed: {stack.runtimes.error}"
    assert "gpuaas-jupyter" in stack.runtimes.pushed, f"gpuaas-jupyter not pushed: {stack.runtimes.error}"
    await console_served(stack, gw)
    team = await new_team(gw, "jup", "Jupyter", "notebooks", "ada", "bob", PASSWORD)
    run, tid, pid = team.run, team.tenant_id, team.project_id
    slug = f"jup-{run}"
    carol = await _user(gw, tid, f"carol-{run}@{slug}.example.com")  # a viewer of the project
    r = await gw.post(f"/api/identity/projects/{pid}/members", json={"user_id": carol, "role": "viewer"})
    assert r.status_code == 201, r.text
    other = await new_team(gw, "jupx", "Other", "elsewhere", "eve", "mallory", PASSWORD)
    # The devstack seeds the images (and the launchable app of gpuaas-jupyter) in the background.
    assert await asyncio.to_thread(stack.runtimes.wait_seeded, 600), stack.runtimes.seed_error

    async def entitled() -> bool:
        r = await gw.post("/api/catalog/entitlements", json={"tenant_id": tid, "app_slug": "jupyter"})
        return r.status_code in (201, 409)

    await eventually(entitled, 120, "tenant entitled to jupyter", interval_s=1)

    host_name = f"jup-{run}"
    r = await gw.post("/api/allocations/hosts", json={"name": host_name, "host_class": host_name})
    assert r.status_code == 201, r.text
    host = r.json()
    agent = start_agent(target_of(stack), host["node_token"], host_name, f"1x{GPU_MODEL}")
    try:
        ada = {"Authorization": f"Bearer {await _login(stack, team.admin_email)}"}
        bob_token = await _login(stack, f"bob-{run}@{slug}.example.com")
        carol_token = await _login(stack, f"carol-{run}@{slug}.example.com")
        eve_token = await _login(stack, other.admin_email)

        async def host_ready() -> bool:
            return (await gw.get(f"/api/allocations/hosts/{host['host_id']}")).json().get("status") == "ready"

        await eventually(host_ready, 240, "host ready")
        body = {
            "name": "lab",
            "app_slug": "jupyter",
            "placement_intent": {"mode": "launch", "gpu_model": GPU_MODEL, "gpu_count": 1},
        }
        deployed: dict = {}

        async def deploy() -> bool:  # app-runtime's projections know the project, the entitlement and the app
            r = await gw.post(f"/api/app-runtime/projects/{pid}/instances", json=body, headers=ada)
            if r.status_code == 201:
                deployed.update(r.json())
            return r.status_code == 201

        await eventually(deploy, 90, "jupyter deployed", interval_s=1)
        t0 = time.monotonic()
        iid = deployed["instance_id"]
        assert deployed["app_version"] == "1.1.0" and deployed["placement_intent"]["mode"] == "launch"
        alloc_id = deployed["runtime_detail"]["workload"]["allocation_id"]

        async def running() -> dict | None:
            inst = (await gw.get(f"/api/app-runtime/instances/{iid}")).json()
            assert inst["status"] not in ("failed", "decommissioned"), (inst["failure_reason"], inst["runtime_detail"])
            return inst if inst["status"] == "running" else None

        inst = await eventually(running, 300, "instance running (health check answered)", interval_s=0.5)
        deploy_to_running_s = time.monotonic() - t0
        assert inst["runtime_detail"]["workload"]["healthy"] is True
        assert inst["runtime_detail"]["workload"]["open_path"] == f"/apps/{iid}/"
        alloc = (await gw.get(f"/api/allocations/allocations/{alloc_id}")).json()
        assert alloc["status"] == "active" and alloc["project_id"] == pid
        row = await stack.fetch(
            "allocations", "SELECT runtime, driver FROM allocations WHERE allocation_id = $1", uuid.UUID(alloc_id)
        )
        runtime = json.loads(row[0]["runtime"]) if isinstance(row[0]["runtime"], str) else row[0]["runtime"]
        assert row[0]["driver"] == "container" and runtime["digest"] == stack.runtimes.pushed["gpuaas-jupyter"].digest
        endpoint = runtime["workload_endpoint"]

        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30, follow_redirects=False) as c:
            # The access rules of the proxy. Without a bearer token a caller is a browser: it goes to the app's
            # own origin, and there it must sign in.
            app_host = f"{iid}.{APPS_DOMAIN}:{urlsplit(stack.gateway_url).port}"
            r = await c.get(f"/apps/{iid}/api/status")
            assert r.status_code == 307 and r.headers["location"].startswith(f"http://{app_host}/"), r.headers
            assert (await c.get(f"/apps/{iid}/api/status", headers={"host": app_host})).status_code == 401
            r = await c.get(f"/apps/{iid}/api/status", headers={"Authorization": f"Bearer {eve_token}"})
            assert r.status_code == 404, r.text  # another tenant: the instance's existence stays hidden
            r = await c.get(f"/apps/{iid}/api/status", headers={"Authorization": f"Bearer {carol_token}"})
            assert r.status_code == 403, r.text  # a viewer may read the instance, not run code in it
            r = await c.get(f"/apps/{uuid.uuid4()}/api/status", headers=ada)
            assert r.status_code == 404
            r = await c.get(f"/apps/{iid}/api/status", headers=ada)
            assert r.status_code == 200 and "kernels" in r.json(), r.text
            # The workload itself refuses anyone without the platform's secret (its published port).
            async with httpx.AsyncClient(timeout=10, trust_env=False) as direct:
                r = await direct.get(f"http://{endpoint['host']}:{endpoint['port']}/apps/{iid}/api/status")
                assert r.status_code == 403, r.text
                r = await direct.get(
                    f"http://{endpoint['host']}:{endpoint['port']}/apps/{iid}/api/status",
                    headers={"Authorization": f"token {ada['Authorization'].split()[1]}"},
                )
                assert r.status_code == 403  # the platform token is not the workload's secret
            # The page: a browser goes to the app's own origin (bearer calls above were served where they came),
            # where the token goes into an HttpOnly cookie for this app only, and the URL loses it.
            opened = f"/apps/{iid}/?access_token={ada['Authorization'].split()[1]}"
            r = await c.get(opened)
            assert r.status_code == 307 and r.headers["location"] == f"http://{app_host}{opened}", r.headers
            r = await c.get(opened, headers={"host": app_host})
            assert r.status_code == 303 and r.headers["location"] == f"/apps/{iid}/", r.headers
            cookie = r.headers["set-cookie"]
            assert "HttpOnly" in cookie and f"Path=/apps/{iid}/" in cookie and "SameSite=lax" in cookie, cookie
            r = await c.get("/api/identity/me", headers={**ada, "host": app_host})
            assert r.status_code == 404, r.text  # the app's host serves the app only: no API, no console
        audited = await _audited(stack, iid)
        assert audited >= 1  # the token exchange above

        # A real browser: JupyterLab through the gateway, a cell computed.
        result = await run_browser(
            "jupyter.e2e.mjs",
            {
                "GATEWAY_URL": stack.gateway_url,
                "INSTANCE_ID": iid,
                "ACCESS_TOKEN": ada["Authorization"].split()[1],
                "SCREENSHOT_DIR": str(stack.root / "jupyter-screenshots"),
                "USER_EMAIL": team.admin_email,
                "USER_PASSWORD": PASSWORD,
                "APPS_DOMAIN": APPS_DOMAIN,
            },
        )
        assert result["output"] == "570", result
        assert result["appOrigin"] == f"http://{app_host}", result  # its own origin, in the browser too
        assert result["consoleStorageSeenByApp"] == [], result  # the console's session is out of its reach
        assert result["reopened"] is True, result  # an expired app session came back through the console
        assert await _audited(stack, iid) > audited  # the browser's open and its kernel WebSocket

        # A member's open kernel session is closed when the membership is revoked.
        bob = {"Authorization": f"Bearer {bob_token}"}
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
            r = await c.post(f"/apps/{iid}/api/kernels", headers=bob, json={"name": "python3"})
            assert r.status_code == 201, r.text
            kernel = r.json()["id"]
        ws_url = stack.gateway_url.replace("http", "ws", 1) + f"/apps/{iid}/api/kernels/{kernel}/channels"
        async with connect(ws_url, additional_headers=bob, open_timeout=30) as ws:
            await ws.send(json.dumps(_execute("6 * 7")))
            assert await _reply_text(ws) == "42"
            memberships = (await gw.get(f"/api/identity/projects/{pid}/members")).json()
            bob_membership = next(m for m in memberships if m["user_id"] == team.member_id)
            revoked_at = time.monotonic()
            r = await gw.delete(f"/api/identity/memberships/{bob_membership['membership_id']}")
            assert r.status_code == 204, r.text
            with pytest.raises(ConnectionClosed) as closed:
                async with asyncio.timeout(40):
                    while True:
                        await ws.recv()
            close_after_s = time.monotonic() - revoked_at
            # 4404: no longer a member, the instance is hidden from bob (no existence leak), as his next request
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404, closed.value
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
            r = await c.get(f"/apps/{iid}/api/status", headers=bob)
            assert r.status_code == 404, r.text

        # App-hours are metered for the instance (one record per closed window; the open one is not yet).
        r = await gw.post(f"/api/app-runtime/instances/{iid}/decommission", json={"reason": "test done"}, headers=ada)
        assert r.status_code == 200, r.text

        async def decommissioned() -> bool:
            inst = (await gw.get(f"/api/app-runtime/instances/{iid}")).json()
            return inst["status"] == "decommissioned"

        await eventually(decommissioned, 120, "instance decommissioned (allocation released)", interval_s=0.5)
        alloc = (await gw.get(f"/api/allocations/allocations/{alloc_id}")).json()
        assert alloc["status"] == "released", alloc
        print(
            f"deploy_to_running_s={deploy_to_running_s:.1f} revoke_to_close_s={close_after_s:.1f}"
            f" cell_run_attempts={result.get('runAttempts')}"  # >1: JupyterLab skipped a run before its kernel was up
        )
    finally:
        stop_process(agent)


async def _audited(stack: Stack, instance_id: str) -> int:
    """Opens recorded on the instance's timeline (in the transaction of the audit record itself)."""
    sql = "SELECT count(*) FROM instance_events WHERE instance_id = $1 AND kind = 'instance.opened'"
    return int(await stack.fetchval("app_runtime", sql, uuid.UUID(instance_id)) or 0)


def _execute(code: str) -> dict:
    msg_id = uuid.uuid4().hex
    return {
        "header": {
            "msg_id": msg_id,
            "msg_type": "execute_request",
            "username": "t",
            "session": uuid.uuid4().hex,
            "version": "5.3",
        },
        "parent_header": {},
        "metadata": {},
        "content": {
            "code": code,
            "silent": False,
            "store_history": False,
            "user_expressions": {},
            "allow_stdin": False,
        },
        "channel": "shell",
        "buffers": [],
    }


async def _reply_text(ws) -> str:
    async with asyncio.timeout(60):
        while True:
            msg = json.loads(await ws.recv())
            if msg.get("msg_type") == "execute_result":
                return str(msg["content"]["data"]["text/plain"])
