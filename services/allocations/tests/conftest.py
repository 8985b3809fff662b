"""The allocations service on a real loopback port (uvicorn, this event loop) with real agents
(gpuaas.node_agent, in-process) and a seeded IAM projection. Per test: fresh schema, fresh agents."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh
import httpx
import pytest
import uvicorn

from gpuaas.allocations.app import SPEC
from gpuaas.contracts import Event
from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.events import identity as identity_events
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.iam import apply_locally
from gpuaas.kit.kafka import make_producer
from gpuaas.kit.testing import service_app, wait_for
from gpuaas.kit.testing_events import signed_payload
from gpuaas.node_agent.agent import Agent
from gpuaas.node_agent.settings import AgentSettings


class _Server(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _membership(
    user: uuid.UUID, role: Role, tenant: uuid.UUID | None = None, project: uuid.UUID | None = None
) -> Event:
    scope = MembershipScope.project if project else MembershipScope.tenant if tenant else MembershipScope.platform
    m = identity_events.MembershipState(
        membership_id=uuid.uuid4(), user_id=user, scope=scope, role=role, tenant_id=tenant, project_id=project
    )
    return identity_events.MembershipGranted.build(subject=m.membership_id, data=m, source="identity")


@dataclass
class World:
    url: str
    kit: KitRuntime
    signer: Any
    tmp: Path
    ids: dict[str, uuid.UUID]
    agents: list[tuple[Agent, asyncio.Task[None]]] = field(default_factory=list)
    background: list[asyncio.Task[None]] = field(default_factory=list)

    def client(self, who: str) -> httpx.AsyncClient:
        token = self.signer.token(self.ids[who])
        return httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def token(self, who: str) -> str:
        return str(self.signer.token(self.ids[who]))

    async def enrol(self, name: str, gpus: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        async with self.client("op") as c:
            r = await c.post("/hosts", json={"name": name, "gpus": gpus or []})
            assert r.status_code == 201, r.text
            return dict(r.json())

    async def start_agent(self, token: str, name: str, gpus: str = "8xH100-80GB", **overrides: Any) -> Agent:
        # The control plane's tests run the process driver (no runtime image needed); the container
        # driver is tested by the agent's own tests and the isolation suite through the stack.
        overrides.setdefault("driver", "process")
        settings = AgentSettings(
            server_url=self.url,
            node_token=token,
            state_dir=self.tmp / name,
            gpus=gpus,
            prefer_nvidia_smi=False,
            long_poll_s=5,
            heartbeat_interval_s=1,
            **overrides,
        )
        agent = Agent(settings)
        task = asyncio.create_task(agent.run())
        self.agents.append((agent, task))
        await wait_for(lambda: agent.registered.is_set() or task.done(), 30, "agent registration")
        assert not task.done(), task.exception()
        return agent

    async def stop_agent(self, agent: Agent) -> None:
        for a, t in list(self.agents):
            if a is agent:
                t.cancel()
                with suppress(asyncio.CancelledError, Exception):
                    await t
                self.agents.remove((a, t))

    async def host_with_agent(self, name: str = "gpu-1", gpus: str = "8xH100-80GB", **kw: Any) -> tuple[dict, Agent]:
        host = await self.enrol(name)
        agent = await self.start_agent(host["node_token"], name, gpus, **kw)
        return host, agent

    async def wait_status(self, who: str, alloc_id: str, *statuses: str, timeout_s: float = 30) -> dict[str, Any]:
        async with self.client(who) as c:

            async def check() -> Any:
                r = await c.get(f"/allocations/{alloc_id}")
                return r.json() if r.json().get("status") in statuses else None

            return dict(await wait_for(check, timeout_s, f"allocation {alloc_id} in {statuses}"))

    async def create(self, who: str, project: str = "p1", **body: Any) -> httpx.Response:
        async with self.client(who) as c:
            return await c.post(
                f"/projects/{self.ids[project]}/allocations", json={"gpu_model": "H100-80GB", "gpu_count": 1, **body}
            )


async def last_seq(c: httpx.AsyncClient, aid: str) -> int:
    """The allocation's newest timeline entry: what a later `task_done` counts from."""
    return max((e["seq"] for e in (await c.get(f"/allocations/{aid}/timeline")).json()), default=0)


async def task_done(c: httpx.AsyncClient, aid: str, kind: str, after: int, timeout_s: float = 20) -> None:
    """Wait for the progress signal of agent work: the agent reported a `kind` task of the allocation done
    (a timeline entry after `after`). A failed one fails the test at once."""

    async def done() -> bool:
        entries = (await c.get(f"/allocations/{aid}/timeline", params={"after": after})).json()
        mine = [e for e in entries if e["phase"] == kind]
        assert not [e for e in mine if e["status"] == "failed"], mine
        return any(e["status"] == "succeeded" for e in mine)

    await wait_for(done, timeout_s, f"{kind} of {aid} done")


def ssh_key() -> tuple[asyncssh.SSHKey, str]:
    key = asyncssh.generate_private_key("ssh-ed25519")
    return key, key.export_public_key().decode().strip()


async def ssh_run(alloc: dict[str, Any], key: asyncssh.SSHKey, command: str) -> asyncssh.SSHCompletedProcess:
    ep = alloc["ssh_endpoint"]
    async with asyncssh.connect(
        ep["host"],
        ep["port"],
        username=ep["username"],
        client_keys=[key],
        known_hosts=None,
        agent_path=None,
        config=None,
    ) as conn:
        return await conn.run(command, check=False, timeout=20)


async def ssh_refused(alloc: dict[str, Any], key: asyncssh.SSHKey) -> bool:
    try:
        await ssh_run(alloc, key, "true")
    except asyncssh.PermissionDenied:
        return True
    return False


@pytest.fixture
async def world(infra, signer, tmp_path, request: pytest.FixtureRequest) -> AsyncIterator[World]:
    settings: dict[str, Any] = {
        "agent_heartbeat_interval_s": 1.0,
        "agent_heartbeat_timeout_s": 3.0,
        "reconcile_interval_s": 0.5,
        "release_clearance_timeout_s": 60.0,
        "agent_task_lease_s": 10.0,
        **getattr(
            request, "param", {}
        ),  # a test's own settings: @pytest.mark.parametrize("world", [...], indirect=True)
    }
    app = await service_app(SPEC, infra.admin_url, infra.kafka_bootstrap, **settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = _Server(uvicorn.Config(app, log_level="warning", lifespan="on", ws="websockets-sansio"))
    serve = asyncio.create_task(server.serve(sockets=[sock]))
    await wait_for(lambda: server.started or serve.done(), 60, "allocations server")
    assert not serve.done(), serve.exception()
    kit: KitRuntime = app.state.kit
    kit.verifier.jwks.set(signer.jwks)
    ids = {
        k: uuid.uuid4()
        for k in ("t1", "t2", "p1", "p2", "px", "op", "owner", "admin", "grantee", "viewer", "stranger", "tadmin")
    }
    events: list[Event] = [
        _membership(ids["op"], Role.platform_admin),
        identity_events.TenantCreated.build(
            subject=ids["t1"],
            source="identity",
            data=identity_events.TenantState(tenant_id=ids["t1"], slug="t1", name="T1"),
        ),
        identity_events.TenantCreated.build(
            subject=ids["t2"],
            source="identity",
            data=identity_events.TenantState(tenant_id=ids["t2"], slug="t2", name="T2"),
        ),
        *[
            identity_events.ProjectCreated.build(
                subject=ids[p],
                source="identity",
                data=identity_events.ProjectState(project_id=ids[p], tenant_id=ids[t], name=p),
            )
            for p, t in (("p1", "t1"), ("p2", "t1"), ("px", "t2"))
        ],
        _membership(ids["owner"], Role.project_member, ids["t1"], ids["p1"]),
        _membership(ids["owner"], Role.project_member, ids["t1"], ids["p2"]),
        _membership(ids["admin"], Role.project_admin, ids["t1"], ids["p1"]),
        _membership(ids["grantee"], Role.project_member, ids["t1"], ids["p1"]),
        _membership(ids["viewer"], Role.viewer, ids["t1"], ids["p1"]),
        _membership(ids["tadmin"], Role.tenant_admin, ids["t1"]),
        _membership(ids["stranger"], Role.tenant_admin, ids["t2"]),
    ]
    async with kit.sessions() as s, s.begin():
        for e in events:
            await apply_locally(s, e)
    w = World(url=f"http://127.0.0.1:{port}", kit=kit, signer=signer, tmp=tmp_path, ids=ids)
    try:
        yield w
    finally:
        for agent, _ in list(w.agents):
            await w.stop_agent(agent)
        for t in w.background:
            t.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await t
        server.should_exit = True
        with suppress(Exception):
            await asyncio.wait_for(serve, 30)
        sock.close()


class FakeAgent:
    """A host's agent speaking the real agent API over HTTP with no runtime behind it: it registers what
    a test says (driver, tenancy, host key, endpoint), leases the host's tasks and completes them as told.
    For the control plane's rules about hosts (pins, placement, payloads) without podman or a registry."""

    def __init__(self, url: str, token: str) -> None:
        self.token = token
        self.client = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        self.host_key = asyncssh.generate_private_key("ssh-ed25519")
        self.leased: list[dict[str, Any]] = []  # leased and not completed yet (a poll leases every pending task)
        self.heartbeats: asyncio.Task[None] | None = None

    @property
    def public_host_key(self) -> str:
        return self.host_key.export_public_key().decode().strip()

    async def register(self, **fields: Any) -> httpx.Response:
        body = {
            "agent_version": "fake",
            "gpus": [{"index": i, "model": "H100-80GB", "memory_mb": 81920} for i in range(8)],
            "ssh_host": "127.0.0.1",
            "ssh_port": 2222,
            "driver": "container",
            "isolates_tenants": True,
            "cpu_count": 16,
            "memory_mb": 65536,
            "ssh_host_key": self.public_host_key,
            **fields,
        }
        r = await self.client.post("/agent/register", json=body)
        if r.status_code == 200 and self.heartbeats is None:  # else the host turns unreachable in 3 s
            self.heartbeats = asyncio.create_task(self._heartbeat())
        return r

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            with suppress(httpx.HTTPError):
                await self.client.post("/agent/heartbeat")

    async def tasks(self, wait_s: float = 5) -> list[dict[str, Any]]:
        r = await self.client.get("/agent/tasks", params={"wait_s": wait_s})
        assert r.status_code == 200, r.text
        return list(r.json())

    async def task_for(self, allocation_id: str, kind: str, timeout_s: float = 20) -> dict[str, Any]:
        async def leased() -> dict[str, Any] | None:
            self.leased.extend(await self.tasks(0.5))
            found = next((t for t in self.leased if t["allocation_id"] == allocation_id and t["kind"] == kind), None)
            if found is not None:
                self.leased.remove(found)
            return found

        return dict(await wait_for(leased, timeout_s, f"{kind} task of {allocation_id}"))

    async def complete(self, task: dict[str, Any], ok: bool = True, message: str = "", **result: Any) -> None:
        r = await self.client.post(
            f"/agent/tasks/{task['task_id']}/complete", json={"ok": ok, "message": message, "result": result}
        )
        assert r.status_code == 200 and r.json()["applied"], r.text

    async def aclose(self) -> None:
        if self.heartbeats is not None:
            self.heartbeats.cancel()
            with suppress(asyncio.CancelledError):
                await self.heartbeats
        await self.client.aclose()


async def publish_events(bootstrap: str, *events: Event) -> None:
    """Events onto their topics through the real broker, signed with their source's test key (what another
    service's relay would send: an unsigned event is parked, never applied)."""
    producer = make_producer(bootstrap, 1_000_000)
    await producer.start()
    try:
        for e in events:
            await producer.send_and_wait(e.topic, signed_payload(e), key=e.key())
    finally:
        await producer.stop()
