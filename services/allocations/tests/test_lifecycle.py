"""Allocation lifecycle with a real agent: provision, SSH (owner / grantee / stranger / revoked),
browser terminal, restart-in-place, resize, release, timeline and the events metering reads."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from sqlalchemy import text

from gpuaas.kit.testing import wait_for
from gpuaas.node_agent.workspace import processes_of

from .conftest import World, last_seq, ssh_key, ssh_refused, ssh_run, task_done

pytestmark = pytest.mark.integration


async def outbox_types(w: World, alloc_id: str) -> list[dict]:
    async with w.kit.sessions() as s:
        rows = await s.execute(
            text("SELECT event_type, payload FROM outbox WHERE aggregate_id = :a ORDER BY seq"), {"a": alloc_id}
        )
        return [{"type": r.event_type, **json.loads(r.payload)} for r in rows]


async def test_full_lifecycle_over_real_ssh(world: World) -> None:
    w = world
    _host, agent = await w.host_with_agent("gpu-1", "8xH100-80GB")
    owner_key, owner_pub = ssh_key()
    grantee_key, grantee_pub = ssh_key()
    stranger_key, _ = ssh_key()
    async with w.client("owner") as c:
        assert (await c.post("/ssh-keys", json={"name": "laptop", "public_key": owner_pub})).status_code == 201
        r = await w.create("owner", name="train", gpu_count=2)
        assert r.status_code == 201, r.text
        created = r.json()
        assert created["status"] == "provisioning" and len(created["gpu_indices"]) == 2
        assert "nothing persists" in created["after_release"]
        alloc = await w.wait_status("owner", created["allocation_id"], "active")
        aid = alloc["allocation_id"]
        assert alloc["ssh_endpoint"]["port"] == agent.ssh_port and alloc["activated_at"]

        # The owner gets in, inside the workspace, with exactly the slice's GPUs visible.
        out = await ssh_run(alloc, owner_key, "echo $CUDA_VISIBLE_DEVICES; echo $HOME; whoami >/dev/null; echo ok")
        lines = out.stdout.split()
        assert out.exit_status == 0 and lines[0] == ",".join(map(str, alloc["gpu_indices"])) and lines[-1] == "ok"
        assert lines[1].endswith(f"{aid}/home")
        assert (await ssh_run(alloc, owner_key, "exit 7")).exit_status == 7
        assert await ssh_refused(alloc, stranger_key)
        assert await ssh_refused(alloc, grantee_key)

        # A grant lets another project member in with their own key; a stranger cannot be granted.
        seen = await last_seq(c, aid)
        r = await c.post(
            f"/allocations/{aid}/ssh-grants", json={"user_id": str(w.ids["grantee"]), "public_key": grantee_pub}
        )
        assert r.status_code == 201, r.text
        grant = r.json()
        r = await c.post(
            f"/allocations/{aid}/ssh-grants", json={"user_id": str(w.ids["stranger"]), "public_key": grantee_pub}
        )
        assert r.status_code == 422 and r.json()["code"] == "grantee_not_member"

        await task_done(c, aid, "sync_ssh_keys", seen)
        assert (await ssh_run(alloc, grantee_key, "echo in")).stdout.strip() == "in"
        async with w.client("viewer") as v:
            r = await v.delete(f"/allocations/{aid}/ssh-grants/{grant['grant_id']}")
            assert r.status_code == 403
        seen = await last_seq(c, aid)
        r = await c.delete(f"/allocations/{aid}/ssh-grants/{grant['grant_id']}")
        assert r.status_code == 200 and r.json()["status"] == "revoked"
        await task_done(c, aid, "sync_ssh_keys", seen)
        assert await ssh_refused(alloc, grantee_key)

        # Browser terminal: a pty over the platform's short-lived certificate.
        ws_url = w.url.replace("http", "ws") + f"/allocations/{aid}/terminal?access_token={w.token('owner')}"
        async with websockets.connect(ws_url) as ws:
            await ws.send("echo term-$((6*7))\n")
            seen = b""
            while b"term-42" not in seen:
                frame = await asyncio.wait_for(ws.recv(), 10)
                seen += frame if isinstance(frame, bytes) else frame.encode()
        stranger_ws = w.url.replace("http", "ws") + f"/allocations/{aid}/terminal?access_token={w.token('stranger')}"
        async with websockets.connect(stranger_ws) as ws:
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 10)
            assert closed.value.rcvd.code == 4404

        # Restart in place: same endpoint and keys; running processes are gone.
        await ssh_run(alloc, owner_key, "setsid nohup sleep 300 >/dev/null 2>&1 & echo started")
        await wait_for(lambda: bool(processes_of(aid)), 5, "background process")
        r = await c.post(f"/allocations/{aid}/restart")
        assert r.status_code == 202 and r.json()["status"] == "restarting"
        restarted = await w.wait_status("owner", aid, "active")
        assert restarted["ssh_endpoint"] == alloc["ssh_endpoint"] and restarted["allocation_id"] == aid
        assert processes_of(aid) == []
        assert (await ssh_run(restarted, owner_key, "echo back")).stdout.strip() == "back"

        # Resize on the host; a size the host cannot give is refused clearly.
        r = await c.post(f"/allocations/{aid}/resize", json={"gpu_count": 4})
        assert r.status_code == 202, r.text
        resized = await w.wait_status("owner", aid, "active")
        assert resized["gpu_count"] == 4 and len(resized["gpu_indices"]) == 4
        out = await ssh_run(resized, owner_key, "echo $CUDA_VISIBLE_DEVICES")
        assert out.stdout.strip() == ",".join(map(str, resized["gpu_indices"]))
        r = await c.post(f"/allocations/{aid}/resize", json={"gpu_count": 9})
        assert r.status_code == 409 and r.json()["code"] == "insufficient_gpus_on_host"
        r = await c.post(f"/allocations/{aid}/resize", json={"gpu_count": 1})
        assert r.status_code == 202
        assert (await w.wait_status("owner", aid, "active"))["gpu_count"] == 1

        # Release: billing stops at the request; everything is removed and verified.
        r = await c.post(f"/allocations/{aid}/release")
        assert r.status_code == 202 and r.json()["billing_stopped_at"]
        released = await w.wait_status("owner", aid, "released")
        assert released["billing_stopped_at"] == r.json()["billing_stopped_at"]
        assert not (agent.state_dir / "allocations" / aid).exists()
        assert await ssh_refused(alloc, owner_key)
        r = await c.post(f"/allocations/{aid}/restart")
        assert r.status_code == 409 and r.json()["code"] == "invalid_state_transition"

        timeline = (await c.get(f"/allocations/{aid}/timeline")).json()
        phases = {(e["phase"], e["status"]) for e in timeline}
        for expected in [
            ("placement", "succeeded"),
            ("provision.workspace", "succeeded"),
            ("provision", "succeeded"),
            ("restart.interrupt", "succeeded"),
            ("resize", "succeeded"),
            ("release.verify", "succeeded"),
            ("release", "succeeded"),
            ("access", "info"),
        ]:
            assert expected in phases, expected
        assert all(e["started_at"] for e in timeline)

        # SSE stream replays the timeline for a late subscriber.
        async with c.stream("GET", f"/allocations/{aid}/timeline/stream") as resp:
            assert resp.status_code == 200
            got = 0
            async for line in resp.aiter_lines():
                if line.startswith("event: timeline"):
                    got += 1
                if got >= 3:
                    break
            assert got >= 3

    types = [e["type"] for e in await outbox_types(w, aid)]
    for t in [
        "allocation.requested",
        "allocation.provisioning",
        "allocation.activated",
        "allocation.restarting",
        "allocation.restarted",
        "allocation.resizing",
        "allocation.resized",
        "allocation.release_requested",
        "allocation.released",
    ]:
        assert t in types, t
    released_evt = next(e for e in await outbox_types(w, aid) if e["type"] == "allocation.released")["data"]
    assert released_evt["billing_stopped_at"] and released_evt["released_at"] and released_evt["version"] > 1


async def test_reads_are_scoped(world: World) -> None:
    w = world
    host, _ = await w.host_with_agent("gpu-1", "8xH100-80GB")
    r = await w.create("owner")
    aid = r.json()["allocation_id"]
    async with w.client("stranger") as c:
        assert (await c.get(f"/allocations/{aid}")).status_code == 404
        assert (await c.post(f"/allocations/{aid}/release")).status_code == 404
        assert (await c.get("/allocations")).json() == []
    async with w.client("viewer") as c:
        assert (await c.get(f"/allocations/{aid}")).status_code == 200
        assert (await c.post(f"/allocations/{aid}/release")).status_code == 403
        r = await c.post(f"/projects/{w.ids['p1']}/allocations", json={"gpu_model": "H100-80GB", "gpu_count": 1})
        assert r.status_code == 403
    async with w.client("owner") as c:
        assert (await c.get("/hosts")).status_code == 403
        r = await c.post(f"/projects/{w.ids['p1']}/allocations", json={"gpu_model": "H100-80GB"})
        assert r.status_code == 422 and r.json()["code"] == "gpu_count_required"
        r = await c.post(f"/projects/{w.ids['p1']}/allocations", json={"gpu_model": "B200", "gpu_count": 1})
        assert r.status_code == 422 and r.json()["code"] == "unknown_gpu_model"
        r = await c.post(f"/projects/{w.ids['p1']}/allocations", json={"gpu_model": "H100-80GB", "gpu_count": 0})
        assert r.status_code == 422
        r = await c.post("/ssh-keys", json={"name": "bad", "public_key": "ssh-ed25519 not-base64!!"})
        assert r.status_code == 422 and r.json()["code"] == "invalid_public_key"
    async with httpx.AsyncClient(base_url=w.url) as anon:
        assert (await anon.get("/agent/tasks", headers={"Authorization": "Bearer gpn_nope"})).status_code == 401
        async with w.client("op") as op:
            rotated = await op.post(f"/hosts/{host['host_id']}/node-token")
            assert rotated.status_code == 200
        old = {"Authorization": f"Bearer {host['node_token']}"}
        new = {"Authorization": f"Bearer {rotated.json()['node_token']}"}
        assert (await anon.post("/agent/heartbeat", headers=old)).status_code == 401
        assert (await anon.post("/agent/heartbeat", headers=new)).status_code == 200
