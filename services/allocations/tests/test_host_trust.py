"""What a node token alone can no longer do, and who may share a host: the SSH host key and endpoint
pinned at the first registration (or enrolment) and reset only by an operator's re-enrolment; the
allocation's endpoint built from the enrolled host, never from a completion; the browser terminal
refusing an endpoint whose key is not the pinned one; placement by tenancy with the audited operator
override; the release evidence the agent reports kept on the allocation."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncssh
import pytest
import websockets
from sqlalchemy import text

from .conftest import FakeAgent, World, ssh_key

pytestmark = pytest.mark.integration


async def enrol(w: World, name: str, **body: Any) -> dict[str, Any]:
    async with w.client("op") as c:
        r = await c.post("/hosts", json={"name": name, **body})
        assert r.status_code == 201, r.text
        return dict(r.json())


async def audit_actions(w: World, resource_id: str) -> list[dict[str, Any]]:
    """The audit records allocations emitted about a resource (its outbox, in order)."""
    async with w.kit.sessions() as s:
        rows = await s.execute(
            text("SELECT payload FROM outbox WHERE event_type = 'audit.recorded' AND aggregate_id = :r ORDER BY seq"),
            {"r": resource_id},
        )
        return [json.loads(r.payload)["data"] for r in rows]


def fingerprint(public_key: str) -> str:
    return str(asyncssh.import_public_key(public_key).get_fingerprint("sha256"))


async def test_host_key_and_endpoint_pinned_until_reenrolment(world: World) -> None:
    w = world
    host = await enrol(w, "pin-1")
    agent = FakeAgent(w.url, host["node_token"])
    impostor_key = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    try:
        r = await agent.register()
        assert r.status_code == 200, r.text
        async with w.client("op") as op:
            view = (await op.get(f"/hosts/{host['host_id']}")).json()
        assert view["ssh_host_key_fingerprint"] == fingerprint(agent.public_host_key)
        assert (view["driver"], view["isolates_tenants"], view["cpu_count"], view["memory_mb"]) == (
            "container",
            True,
            16,
            65536,
        )
        # Same key and endpoint again (an agent restart): accepted.
        assert (await agent.register()).status_code == 200
        # Whoever holds the node token cannot swap the key or move the endpoint.
        r = await agent.register(ssh_host_key=impostor_key)
        assert r.status_code == 409 and r.json()["code"] == "host_key_mismatch", r.text
        r = await agent.register(ssh_host="203.0.113.9")
        assert r.status_code == 409 and r.json()["code"] == "host_endpoint_mismatch", r.text
        r = await agent.register(ssh_port=2223)
        assert r.status_code == 409 and r.json()["code"] == "host_endpoint_mismatch", r.text
        r = await agent.register(ssh_host_key="ssh-ed25519 not-base64!")
        assert r.status_code == 422 and r.json()["code"] == "invalid_host_key", r.text

        # The operator re-enrols (machine reinstalled): new token, pins reset; the old token is dead.
        async with w.client("op") as op:
            r = await op.post(f"/hosts/{host['host_id']}/re-enrol", json={"reason": "reinstalled"})
            assert r.status_code == 200, r.text
            new_token = r.json()["node_token"]
            assert r.json()["ssh_host_key_fingerprint"] is None
            assert (await op.post(f"/hosts/{host['host_id']}/re-enrol", json={})).status_code == 422
        assert (await agent.register()).status_code == 401
        reinstalled = FakeAgent(w.url, new_token)
        try:
            r = await reinstalled.register(ssh_port=2300)
            assert r.status_code == 200, r.text
            async with w.client("op") as op:
                view = (await op.get(f"/hosts/{host['host_id']}")).json()
            assert view["ssh_host_key_fingerprint"] == fingerprint(reinstalled.public_host_key)
        finally:
            await reinstalled.aclose()
        actions = [a["action"] for a in await audit_actions(w, host["host_id"])]
        assert "allocations.host.reenrol" in actions
    finally:
        await agent.aclose()

    # Pinned at enrolment: the first registration must match what the operator gave.
    pinned_key = asyncssh.generate_private_key("ssh-ed25519")
    host2 = await enrol(
        w,
        "pin-2",
        ssh_host="127.0.0.1",
        ssh_port=2222,
        ssh_host_key=pinned_key.export_public_key().decode().strip(),
    )
    assert host2["ssh_host_key_fingerprint"] == str(pinned_key.get_fingerprint("sha256"))
    second = FakeAgent(w.url, host2["node_token"])
    try:
        r = await second.register()  # its own (other) key
        assert r.status_code == 409 and r.json()["code"] == "host_key_mismatch"
        second.host_key = pinned_key
        assert (await second.register()).status_code == 200
    finally:
        await second.aclose()
    async with w.client("op") as op:
        r = await op.post("/hosts", json={"name": "pin-3", "ssh_host": "10.0.0.1"})
        assert r.status_code == 422  # an endpoint is pinned whole (host and port)


async def test_endpoint_comes_from_the_enrolled_host_and_release_evidence_is_kept(world: World) -> None:
    w = world
    host = await enrol(w, "ep-1")
    agent = FakeAgent(w.url, host["node_token"])
    try:
        assert (await agent.register(driver="process", isolates_tenants=False, ssh_port=2201)).status_code == 200
        r = await w.create("owner")
        assert r.status_code == 201, r.text
        aid = r.json()["allocation_id"]
        task = await agent.task_for(aid, "provision")
        # The completion claims another endpoint (a hijacked token pointing users elsewhere): ignored.
        await agent.complete(task, ssh_host="203.0.113.66", ssh_port=31337, username="root")
        alloc = await w.wait_status("owner", aid, "active")
        assert alloc["ssh_endpoint"]["host"] == "127.0.0.1" and alloc["ssh_endpoint"]["port"] == 2201
        async with w.client("owner") as c:
            timeline = (await c.get(f"/allocations/{aid}/timeline")).json()
            assert any("203.0.113.66:31337" in e["message"] for e in timeline)
            r = await c.post(f"/allocations/{aid}/release")
            assert r.status_code == 202, r.text
        evidence = {
            "container_removed": True,
            "cgroup_empty": True,
            "pid_namespace_gone": True,
            "mounts_gone": True,
            "state_dir_gone": True,
            "checked": ["podman container exists", "cgroup.procs", "/proc/self/mountinfo"],
        }
        await agent.complete(await agent.task_for(aid, "release"), message="released", evidence=evidence)
        released = await w.wait_status("owner", aid, "released")
        assert released["release_evidence"] == evidence
        async with w.client("owner") as c:
            timeline = (await c.get(f"/allocations/{aid}/timeline")).json()
        line = next(e for e in timeline if e["phase"] == "release.evidence")
        assert line["status"] == "succeeded" and "cgroup_empty=yes" in line["message"]
        assert "cgroup.procs" in line["message"]
    finally:
        await agent.aclose()


async def test_placement_by_tenancy_and_the_audited_override(world: World) -> None:
    w = world
    shared = await enrol(w, "shared-1", host_class="tenancy")
    agent = FakeAgent(w.url, shared["node_token"])
    try:
        assert (await agent.register(driver="process", isolates_tenants=False)).status_code == 200
        first = await w.create("owner", host_class="tenancy")
        assert first.status_code == 201, first.text
        # Another tenant: refused while t1 holds GPUs on a host that does not isolate tenants.
        r = await w.create("stranger", "px", host_class="tenancy", queue=False)
        assert r.status_code == 409 and r.json()["code"] == "insufficient_capacity", r.text
        assert "do not isolate tenants" in r.json()["detail"]
        # The same tenant (another project) may share it.
        assert (await w.create("owner", "p2", host_class="tenancy")).status_code == 201
        async with w.client("op") as op:
            r = await op.put(f"/hosts/{shared['host_id']}/tenancy", json={"shared_tenancy_allowed": True})
            assert r.status_code == 422  # a reason is required
            async with w.client("owner") as c:
                r = await c.put(
                    f"/hosts/{shared['host_id']}/tenancy", json={"shared_tenancy_allowed": True, "reason": "x"}
                )
                assert r.status_code == 403
            r = await op.put(
                f"/hosts/{shared['host_id']}/tenancy",
                json={"shared_tenancy_allowed": True, "reason": "lab machine, tenants agreed"},
            )
            assert r.status_code == 200 and r.json()["shared_tenancy_allowed"] is True, r.text
        other = await w.create("stranger", "px", host_class="tenancy")
        assert other.status_code == 201, other.text
        assert other.json()["host_id"] == shared["host_id"]
        audit = [a for a in await audit_actions(w, shared["host_id"]) if a["action"] == "allocations.host.tenancy"]
        assert audit and audit[-1]["reason"] == "lab machine, tenants agreed"
        assert audit[-1]["before"]["shared_tenancy_allowed"] is False
        assert audit[-1]["after"]["shared_tenancy_allowed"] is True
    finally:
        await agent.aclose()

    # A host whose driver isolates tenants takes both without any override.
    isolating = await enrol(w, "iso-1", host_class="iso")
    iso = FakeAgent(w.url, isolating["node_token"])
    try:
        assert (await iso.register(driver="container", isolates_tenants=True)).status_code == 200
        # No runtime is published in this test, so the container host's default runtime is unavailable:
        # the create is refused with the reason rather than placed without an image.
        r = await w.create("owner", host_class="iso")
        assert r.status_code == 422 and r.json()["code"] == "runtime_unavailable"
    finally:
        await iso.aclose()


async def test_terminal_refuses_an_endpoint_whose_host_key_is_not_the_pinned_one(world: World) -> None:
    w = world
    host, agent = await w.host_with_agent("term-1", "2xH100-80GB")
    _key, pub = ssh_key()
    async with w.client("owner") as c:
        assert (await c.post("/ssh-keys", json={"name": "k", "public_key": pub})).status_code == 201
    aid = (await w.create("owner")).json()["allocation_id"]
    await w.wait_status("owner", aid, "active")
    ws_url = w.url.replace("http", "ws") + f"/allocations/{aid}/terminal?access_token={w.token('owner')}"

    async def terminal_echo() -> bool:
        async with websockets.connect(ws_url) as ws:
            await ws.send("echo pinned-$((6*7))\n")
            seen = b""
            while b"pinned-42" not in seen:
                frame = await asyncio.wait_for(ws.recv(), 10)
                seen += frame if isinstance(frame, bytes) else frame.encode()
            # End the shell: the agent's token is revoked below, so no release could stop it later.
            await ws.send("exit\n")
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 10)
        return True

    assert await terminal_echo()  # the agent's real key is the pinned one
    # The operator's record now says another key is the host's (as after a swap of the machine
    # behind the endpoint): the terminal must not talk to the endpoint that answers there.
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    async with w.client("op") as op:
        r = await op.post(
            f"/hosts/{host['host_id']}/re-enrol",
            json={
                "reason": "test: pin a key the endpoint does not hold",
                "ssh_host": agent.s.ssh_bind,
                "ssh_port": agent.ssh_port,
                "ssh_host_key": other,
            },
        )
        assert r.status_code == 200, r.text
    async with websockets.connect(ws_url) as ws:
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 15)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4503
        assert "host key" in closed.value.rcvd.reason


async def test_the_pinned_host_key_is_published_to_readers_and_the_sdk_refuses_another(world: World) -> None:
    """Issue 28: clients verify the host with the key the platform pinned (the browser terminal always did). The
    API gives each reader the endpoint's key and a known_hosts line; the SDK's SSH helper connects when the
    server shows that key and refuses, without retrying, a server that shows another."""
    from gpuaas.sdk.controller import exec as sdk_exec

    w = world
    host = await enrol(w, "pub-1")
    agent = FakeAgent(w.url, host["node_token"])
    server: asyncssh.SSHAcceptor | None = None
    try:
        assert (await agent.register(driver="process", isolates_tenants=False, ssh_port=2202)).status_code == 200
        aid = (await w.create("owner")).json()["allocation_id"]
        async with w.client("owner") as c, w.client("stranger") as other:
            pin = (await c.get(f"/allocations/{aid}/ssh-host-key")).json()
            assert (await other.get(f"/allocations/{aid}/ssh-host-key")).status_code in (403, 404)
        key = " ".join(agent.public_host_key.split()[:2])
        assert pin == {
            "host": "127.0.0.1",
            "port": 2202,
            "username": pin["username"],
            "host_key": key,
            "fingerprint": fingerprint(agent.public_host_key),
            "known_hosts": f"[127.0.0.1]:2202 {key}",
        }
        queued = (await w.create("owner", gpu_count=16)).json()  # no host fits: queued, not placed
        async with w.client("owner") as c:
            r = await c.get(f"/allocations/{queued['allocation_id']}/ssh-host-key")
        assert r.status_code == 409 and r.json()["code"] == "no_ssh_endpoint", r.text

        # A real SSH server showing the pinned key, then one showing another key, at the same endpoint.
        user_key, user_public = ssh_key()

        class Server(asyncssh.SSHServer):
            def begin_auth(self, username: str) -> bool:
                return True

            def public_key_auth_supported(self) -> bool:
                return True

            def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
                return key.export_public_key().decode().split()[:2] == user_public.split()[:2]

        async def serve(host_key: asyncssh.SSHKey) -> tuple[asyncssh.SSHAcceptor, int]:
            acceptor = await asyncssh.create_server(Server, "127.0.0.1", 0, server_host_keys=[host_key])
            return acceptor, acceptor.sockets[0].getsockname()[1]

        private = user_key.export_private_key().decode()
        server, port = await serve(agent.host_key)
        line = pin["known_hosts"].replace("2202", str(port))
        async with sdk_exec.connect(sdk_exec.Endpoint("127.0.0.1", port, "u", known_hosts=line), private, wait_s=5):
            pass
        server.close()
        server, port = await serve(asyncssh.generate_private_key("ssh-ed25519"))
        line = pin["known_hosts"].replace("2202", str(port))
        endpoint = sdk_exec.Endpoint("127.0.0.1", port, "u", known_hosts=line)
        with pytest.raises(sdk_exec.HostKeyMismatch):
            async with sdk_exec.connect(endpoint, private, wait_s=30):
                pass
    finally:
        if server is not None:
            server.close()
        await agent.aclose()
