"""Allocations through the gateway on the real stack, with a real node-agent process:
enrol a host, create an allocation, SSH as owner / grantee / stranger / revoked grantee, the
browser terminal WebSocket, restart (also across a restart of the allocations service and of
the agent), release, timeline."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncssh
import httpx
import pytest
import websockets

from gpuaas.devstack.golden_path.actors import ssh_connect, start_agent
from gpuaas.devstack.infra import stop_process
from gpuaas.devstack.pytest_plugin import target_of
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually

pytestmark = pytest.mark.e2e


async def login(stack: Stack, email: str, password: str) -> httpx.AsyncClient:
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        r = await c.post(
            "/api/identity/auth/token", data={"grant_type": "password", "username": email, "password": password}
        )
        assert r.status_code == 200, r.text
        token = r.json()["access_token"]
    return httpx.AsyncClient(base_url=stack.gateway_url, timeout=30, headers={"Authorization": f"Bearer {token}"})


async def ssh(alloc: dict, key: asyncssh.SSHKey, command: str) -> str | None:
    try:
        async with ssh_connect(alloc["ssh_endpoint"], key) as conn:
            return (await conn.run(command, check=False, timeout=20)).stdout
    except asyncssh.PermissionDenied:
        return None


@pytest.fixture
async def people(gw: httpx.AsyncClient, stack: Stack) -> AsyncIterator[dict]:
    run = uuid.uuid4().hex[:6]
    tenant = (await gw.post("/api/identity/tenants", json={"slug": f"acme-{run}", "name": "Acme"})).json()
    project = (await gw.post(f"/api/identity/tenants/{tenant['tenant_id']}/projects", json={"name": "ml"})).json()
    out: dict = {"tenant": tenant, "project": project, "clients": []}
    for who in ("alice", "bob", "carol"):
        email, password = f"{who}-{run}@acme-gpu.example.com", "correct-horse-battery"
        r = await gw.post(
            f"/api/identity/tenants/{tenant['tenant_id']}/users",
            json={"email": email, "password": password, "role": None},
        )
        assert r.status_code == 201, r.text
        out[who] = r.json()["user_id"]
        if who != "carol":  # carol belongs to the tenant but not to the project
            r = await gw.post(
                f"/api/identity/projects/{project['project_id']}/members",
                json={"user_id": out[who], "role": "project_member"},
            )
            assert r.status_code in (200, 201), r.text
        client = await login(stack, email, password)
        out[f"{who}_client"] = client
        out[f"{who}_token"] = client.headers["Authorization"].split()[1]
        out["clients"].append(client)
    yield out
    for c in out["clients"]:
        await c.aclose()


async def test_allocation_through_the_gateway(stack: Stack, gw: httpx.AsyncClient, people: dict) -> None:
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    r = await gw.post("/api/allocations/hosts", json={"name": name, "host_class": name})
    assert r.status_code == 201, r.text
    host = r.json()
    agent = start_agent(target_of(stack), host["node_token"], name, "8xH100-80GB")
    try:

        async def ready() -> bool:
            h = (await gw.get(f"/api/allocations/hosts/{host['host_id']}")).json()
            return h.get("status") == "ready" and len(h["gpus"]) == 8

        await eventually(ready, 60, "host ready")
        alice = people["alice_client"]
        pid = people["project"]["project_id"]
        alice_key = asyncssh.generate_private_key("ssh-ed25519")
        bob_key = asyncssh.generate_private_key("ssh-ed25519")
        r = await alice.post(
            "/api/allocations/ssh-keys", json={"name": "laptop", "public_key": alice_key.export_public_key().decode()}
        )
        assert r.status_code == 201, r.text

        async def create() -> dict | None:  # allocations' IAM projection catches up with identity
            r = await alice.post(
                f"/api/allocations/projects/{pid}/allocations",
                json={"gpu_model": "H100-80GB", "gpu_count": 2, "name": "e2e", "host_class": name},
            )
            return r.json() if r.status_code == 201 else None

        created = await eventually(create, 60, "allocation created")

        async def status(*wanted: str) -> dict:
            async def check() -> dict | None:
                a = (await alice.get(f"/api/allocations/allocations/{created['allocation_id']}")).json()
                return a if a.get("status") in wanted else None

            return await eventually(check, 60, f"status in {wanted}")

        alloc = await status("active")
        aid = alloc["allocation_id"]
        assert (await ssh(alloc, alice_key, "echo $CUDA_VISIBLE_DEVICES")).strip() == ",".join(
            map(str, alloc["gpu_indices"])
        )
        assert await ssh(alloc, bob_key, "true") is None

        r = await alice.post(
            f"/api/allocations/allocations/{aid}/ssh-grants",
            json={"user_id": people["bob"], "public_key": bob_key.export_public_key().decode()},
        )
        assert r.status_code == 201, r.text
        grant = r.json()
        r = await alice.post(
            f"/api/allocations/allocations/{aid}/ssh-grants",
            json={"user_id": people["carol"], "public_key": bob_key.export_public_key().decode()},
        )
        assert r.status_code == 422 and r.json()["code"] == "grantee_not_member"

        async def bob_in() -> bool:
            return (await ssh(alloc, bob_key, "echo bob")) == "bob\n"

        await eventually(bob_in, 30, "grantee access")
        assert (await people["carol_client"].get(f"/api/allocations/allocations/{aid}")).status_code in (403, 404)

        r = await alice.delete(f"/api/allocations/allocations/{aid}/ssh-grants/{grant['grant_id']}")
        assert r.status_code == 200

        async def bob_out() -> bool:
            return await ssh(alloc, bob_key, "true") is None

        await eventually(bob_out, 30, "revoked grantee refused")

        # Browser terminal through the gateway (token in the query, as a browser sends it).
        ws_url = stack.gateway_url.replace("http", "ws") + (
            f"/api/allocations/allocations/{aid}/terminal?access_token={people['alice_token']}"
        )
        async with websockets.connect(ws_url) as ws:
            await ws.send("echo gw-$((40+2))\n")
            seen = b""
            while b"gw-42" not in seen:
                frame = await asyncio.wait_for(ws.recv(), 15)
                seen += frame if isinstance(frame, bytes) else frame.encode()

        # The service restarts; the agent keeps working with it. Then the agent restarts.
        await asyncio.to_thread(stack.kill, "allocations")
        await asyncio.to_thread(stack.start_service, "allocations")
        stop_process(agent)
        r = await alice.post(f"/api/allocations/allocations/{aid}/restart")
        assert r.status_code == 202, r.text
        agent = start_agent(target_of(stack), host["node_token"], name, "8xH100-80GB")
        restarted = await status("active")
        assert restarted["ssh_endpoint"] == alloc["ssh_endpoint"]
        assert (await ssh(restarted, alice_key, "echo again")) == "again\n"

        r = await alice.post(f"/api/allocations/allocations/{aid}/release")
        assert r.status_code == 202 and r.json()["billing_stopped_at"]
        await status("released")
        timeline = (await alice.get(f"/api/allocations/allocations/{aid}/timeline")).json()
        assert [e for e in timeline if e["phase"] == "release.verify" and e["status"] == "succeeded"]
        assert await ssh(alloc, alice_key, "true") is None
        n = await stack.fetchval(
            "allocations",
            "SELECT count(*) FROM agent_tasks WHERE allocation_id = $1 AND status = 'succeeded' AND kind = 'restart'",
            uuid.UUID(aid),
        )
        assert n == 1

        # The stack's own local agents (make run): an A100 slice is placed and activated at once.
        r = await alice.post(
            f"/api/allocations/projects/{pid}/allocations", json={"gpu_model": "A100-80GB", "gpu_count": 1}
        )
        assert r.status_code == 201, r.text
        local = r.json()

        async def local_active() -> dict | None:
            a = (await alice.get(f"/api/allocations/allocations/{local['allocation_id']}")).json()
            return a if a["status"] == "active" else None

        assert (await eventually(local_active, 60, "allocation on local-a100"))["ssh_endpoint"]
        await alice.post(f"/api/allocations/allocations/{local['allocation_id']}/release")
    finally:
        stop_process(agent)
