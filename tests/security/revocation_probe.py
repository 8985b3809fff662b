"""Revoke-to-refusal probing through the gateway, shared by tests/security/test_revocation.py (asserts) and
bench/revocation.py (measures): a world with an active allocation (real node agent, SSH) and a deployed app
instance, a fresh viewer per trial (project_admin of the project, so it may read everything there and open
the terminal), the viewer's three streams opened, one revocation, then how long until each service refuses
the viewer's token and each stream closes.

Revocations: `logout` (POST /auth/logout), `session_delete` (DELETE /sessions/{id}), `refresh_reuse` (a spent
refresh token presented again), `user_disabled`, `membership_removed`, `token_expiry` (the stack's identity
issues short-lived tokens: see `TOKEN_TTL_S`). An expired token is still accepted for the verifier's
clock-skew leeway (`CLOCK_SKEW_LEEWAY_S`), so for expiry the services' lag is measured from `exp` + leeway;
streams close at `exp` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import websockets
from joserfc import jws
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts.events import catalog as cat
from gpuaas.devstack.golden_path.actors import start_agent
from gpuaas.devstack.infra import stop_process
from gpuaas.devstack.pytest_plugin import target_of
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually
from gpuaas.kit.auth import CLOCK_SKEW_LEEWAY_S
from gpuaas.kit.db import create_engine, session_factory
from gpuaas.kit.outbox import add_events

TOKEN_TTL_S = 30  # identity's access-token lifetime on the revocation stack (expiry is a scenario)
STACK_ENV = {"identity": {"GPUAAS_IDENTITY_ACCESS_TOKEN_TTL_S": str(TOKEN_TTL_S)}}
PASSWORD = "revocation-probe-pw-1"
REVOCATIONS = ("logout", "session_delete", "refresh_reuse", "user_disabled", "membership_removed", "token_expiry")
STREAMS = ("timeline_sse", "instance_sse", "terminal_ws")
# SSH is keys, not tokens: what ends a person's SSH access is losing the access itself (issue 28), not a
# logout. With `ssh=True` these revocations also measure the SSH session's close and a new login's refusal.
SSH_REVOCATIONS = ("user_disabled", "membership_removed")
POLL_S = 0.05


@dataclass
class World:
    stack: Stack
    tenant_id: str
    project_id: str
    allocation_id: str
    instance_id: str
    agent: Any = None

    def close(self) -> None:
        if self.agent is not None:
            stop_process(self.agent)


@dataclass
class Viewer:
    user_id: str
    email: str
    membership_id: str
    access_token: str
    refresh_token: str
    session_id: str
    expires_at: float  # epoch s

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.access_token}"}


@dataclass
class Trial:
    """One revocation: when each service refused (status, code) and each stream closed (how), in s after t0."""

    revocation: str
    refused: dict[str, tuple[float, int, str]] = field(default_factory=dict)
    closed: dict[str, tuple[float, str]] = field(default_factory=dict)


def service_checks(w: World, *, include_user_level: bool) -> dict[str, tuple[str, str]]:
    """One request per service that the viewer may make before the revocation (GET unless noted)."""
    pid = w.project_id
    checks = {
        "identity": ("GET", f"/api/identity/projects/{pid}"),
        "allocations": ("GET", f"/api/allocations/projects/{pid}/allocations"),
        "app-runtime": ("GET", f"/api/app-runtime/instances/{w.instance_id}"),
        "metering": ("GET", f"/api/metering/meters?project_id={pid}"),
        "billing": ("GET", f"/api/billing/costs?project_id={pid}"),
    }
    if include_user_level:  # not tied to the project: a membership removal rightly leaves them allowed
        checks["identity-me"] = ("GET", "/api/identity/me")
        checks["catalog"] = ("GET", "/api/catalog/apps")
        checks["allocations-write"] = ("POST", "/api/allocations/ssh-keys")
    return checks


def _ssh_key_body() -> dict[str, str]:
    import asyncssh

    key = asyncssh.generate_private_key("ssh-ed25519")
    return {"name": f"k-{uuid.uuid4().hex[:6]}", "public_key": key.export_public_key().decode()}


async def _call(client: httpx.AsyncClient, method: str, path: str, auth: dict[str, str]) -> httpx.Response:
    body = _ssh_key_body() if method == "POST" else None
    return await client.request(method, path, headers=auth, json=body)


async def build_world(stack: Stack, gw: httpx.AsyncClient) -> World:
    """A tenant and project, a host with a real node agent, an active allocation, an entitled app and an
    instance deployed on the allocation (all by the operator)."""
    run = uuid.uuid4().hex[:6]
    tenant = (await gw.post("/api/identity/tenants", json={"slug": f"rv-{run}", "name": "Revocation"})).json()
    tid = tenant["tenant_id"]
    pid = (await gw.post(f"/api/identity/tenants/{tid}/projects", json={"name": "rv"})).json()["project_id"]
    name = f"rv-{run}"
    r = await gw.post("/api/allocations/hosts", json={"name": name, "host_class": name})
    assert r.status_code == 201, r.text
    host = r.json()
    agent = start_agent(target_of(stack), host["node_token"], name, "8xH100-80GB")
    world = World(stack, tid, pid, "", "", agent)
    try:

        async def ready() -> bool:
            h = (await gw.get(f"/api/allocations/hosts/{host['host_id']}")).json()
            return h.get("status") == "ready"

        await eventually(ready, 90, "host ready")

        async def create() -> dict[str, Any] | None:
            r = await gw.post(
                f"/api/allocations/projects/{pid}/allocations",
                json={"gpu_model": "H100-80GB", "gpu_count": 1, "name": "rv", "host_class": name},
            )
            return r.json() if r.status_code == 201 else None

        aid = (await eventually(create, 60, "allocation created"))["allocation_id"]

        async def active() -> bool:
            return (await gw.get(f"/api/allocations/allocations/{aid}")).json().get("status") == "active"

        await eventually(active, 90, "allocation active")
        world.allocation_id = aid
        slug = f"rvapp-{run}"
        await _publish_app(stack, slug, uuid.UUID(tid))

        async def deploy() -> str | None:
            r = await gw.post(
                f"/api/app-runtime/projects/{pid}/instances",
                json={
                    "name": "rv",
                    "app_slug": slug,
                    "config": {},
                    "placement_intent": {"mode": "same_node", "controller_allocation_id": aid},
                },
            )
            return r.json()["instance_id"] if r.status_code in (200, 201, 202) else None

        world.instance_id = await eventually(deploy, 60, "instance deployed")
    except BaseException:
        world.close()
        raise
    return world


async def _publish_app(stack: Stack, slug: str, tenant_id: uuid.UUID) -> None:
    """Catalog's manifest and entitlement onto its topic through catalog's outbox (registering through the
    catalog API needs an OCI registry; that path is catalog's own e2e)."""
    manifest = cat.AppManifestState(
        manifest_id=uuid.uuid4(),
        slug=slug,
        display_name="Probe",
        version="1.0.0",
        runtime_version="probe 1",
        artifact_kind=cat.AppArtifactKind.controller,
        artifact_ref="registry.local/apps/probe@sha256:" + "b" * 64,
        roles=[cat.AppRole(key="main")],
        active=True,
        revision=1,
    )
    entitlement = cat.EntitlementState(
        entitlement_id=uuid.uuid4(), tenant_id=tenant_id, app_slug=slug, granted_at=datetime.now(UTC), version=1
    )
    engine = create_engine(stack.database_url("catalog"), "catalog", pool_size=1)
    try:
        session: AsyncSession
        async with session_factory(engine)() as session, session.begin():
            await add_events(
                session,
                [
                    cat.AppRegistered.build(data=manifest, source="catalog"),
                    cat.EntitlementGranted.build(data=entitlement, source="catalog"),
                ],
            )
    finally:
        await engine.dispose()


async def new_viewer(gw: httpx.AsyncClient, w: World) -> Viewer:
    """A fresh project_admin of the world's project, signed in once every service lets it in."""
    email = f"viewer-{uuid.uuid4().hex[:8]}@rv.example.com"
    r = await gw.post(
        f"/api/identity/tenants/{w.tenant_id}/users", json={"email": email, "password": PASSWORD, "role": None}
    )
    assert r.status_code == 201, r.text
    uid = r.json()["user_id"]
    r = await gw.post(f"/api/identity/projects/{w.project_id}/members", json={"user_id": uid, "role": "project_admin"})
    assert r.status_code in (200, 201), r.text
    mid = r.json()["membership_id"]

    async def signed_in() -> Viewer | None:
        r = await gw.post(
            "/api/identity/auth/token", data={"grant_type": "password", "username": email, "password": PASSWORD}
        )
        assert r.status_code == 200, r.text
        t = r.json()
        exp = json.loads(jws.extract_compact(t["access_token"].encode()).payload)["exp"]  # the token's own
        v = Viewer(uid, email, mid, t["access_token"], t["refresh_token"], t["session_id"], float(exp))
        checks = service_checks(w, include_user_level=True)
        statuses = await asyncio.gather(*(_call(gw, m, p, v.auth) for m, p in checks.values()))
        return v if all(s.status_code in (200, 201) for s in statuses) else None

    # The grant reaches every service's projection first (a new login each try: a token lives TOKEN_TTL_S).
    return await eventually(signed_in, 30, "the viewer's membership reaching every service", interval_s=0.3)


@dataclass
class StreamProbe:
    name: str
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    closed_at: float | None = None  # monotonic
    how: str = ""
    task: asyncio.Task[None] | None = None


def _gateway_url(w: World) -> str:
    return w.stack.gateway_url


async def open_streams(w: World, v: Viewer) -> dict[str, StreamProbe]:
    """The viewer's timeline SSE, instance events SSE and terminal WebSocket, through the gateway with the
    token in the query (as a browser sends it); returns once all three are open."""
    base = _gateway_url(w)
    token = v.access_token
    probes = {n: StreamProbe(n) for n in STREAMS}

    async def sse(p: StreamProbe, path: str) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(10, read=120)) as c:
            try:
                async with c.stream(
                    "GET", f"{path}?access_token={token}", headers={"Accept": "text/event-stream"}
                ) as r:
                    if r.status_code != 200:
                        p.how = f"refused {r.status_code}"
                        return
                    p.opened.set()
                    event = ""
                    async for line in r.aiter_lines():
                        if line.startswith("event:"):
                            event = line.split(":", 1)[1].strip()
                    p.how = f"ended after event {event or '-'}"
            except httpx.HTTPError as exc:
                p.how = f"broken {type(exc).__name__}"
            finally:
                p.closed_at = time.monotonic()
                p.opened.set()

    async def terminal(p: StreamProbe) -> None:
        url = (
            base.replace("http", "ws", 1)
            + f"/api/allocations/allocations/{w.allocation_id}/terminal?access_token={token}"
        )
        try:
            async with websockets.connect(url, open_timeout=20) as ws:
                await ws.send("echo rv-$((40+2))\n")
                seen = b""
                while b"rv-42" not in seen:
                    frame = await asyncio.wait_for(ws.recv(), 20)
                    seen += frame if isinstance(frame, bytes) else frame.encode()
                p.opened.set()
                with contextlib.suppress(websockets.ConnectionClosed):
                    while True:
                        await ws.recv()
                p.how = f"closed {ws.close_code} {ws.close_reason}"
        except (OSError, websockets.WebSocketException, TimeoutError) as exc:
            p.how = f"failed {type(exc).__name__}: {exc}"
        finally:
            p.closed_at = time.monotonic()
            p.opened.set()

    probes["timeline_sse"].task = asyncio.create_task(
        sse(probes["timeline_sse"], f"/api/allocations/allocations/{w.allocation_id}/timeline/stream")
    )
    probes["instance_sse"].task = asyncio.create_task(
        sse(probes["instance_sse"], f"/api/app-runtime/instances/{w.instance_id}/events/stream")
    )
    probes["terminal_ws"].task = asyncio.create_task(terminal(probes["terminal_ws"]))
    await asyncio.wait_for(asyncio.gather(*(p.opened.wait() for p in probes.values())), 30)
    for p in probes.values():
        assert p.closed_at is None, f"{p.name} did not open: {p.how}"
    return probes


@dataclass
class SshProbe:
    """The viewer's SSH session on the allocation (a grant of their own key) and how to try a new login."""

    key: Any
    endpoint: dict[str, Any]
    stream: StreamProbe


async def _ssh_connect(endpoint: dict[str, Any], key: Any) -> Any:
    import asyncssh

    return await asyncssh.connect(
        endpoint["host"],
        endpoint["port"],
        username=endpoint["username"],
        client_keys=[key],
        known_hosts=None,
        agent_path=None,
        config=None,
    )


async def open_ssh(gw: httpx.AsyncClient, w: World, v: Viewer) -> SshProbe:
    """The viewer grants their own key SSH on the allocation (a project admin may) and opens a session."""
    import asyncssh

    key = asyncssh.generate_private_key("ssh-ed25519")
    body = {"user_id": v.user_id, "public_key": key.export_public_key().decode().strip()}
    r = await gw.post(f"/api/allocations/allocations/{w.allocation_id}/ssh-grants", headers=v.auth, json=body)
    assert r.status_code == 201, r.text
    endpoint = (await gw.get(f"/api/allocations/allocations/{w.allocation_id}", headers=v.auth)).json()["ssh_endpoint"]

    async def connected() -> Any:
        try:
            return await _ssh_connect(endpoint, key)
        except asyncssh.PermissionDenied:
            return None  # the grant's key sync has not reached the agent yet

    conn = await eventually(connected, 30, "the grant's key on the agent", interval_s=0.1)
    proc = await conn.create_process("sleep 600")
    probe = StreamProbe("ssh_session")

    async def watch() -> None:
        try:
            await proc.wait()
            probe.how = "closed by the agent"
        except asyncssh.Error as exc:
            probe.how = f"closed {type(exc).__name__}"
        finally:
            probe.closed_at = time.monotonic()
            conn.close()

    probe.task = asyncio.create_task(watch())
    return SshProbe(key, endpoint, probe)


async def revoke(gw: httpx.AsyncClient, v: Viewer, how: str) -> float:
    """Perform the revocation; returns t0 (monotonic) from which lags are measured."""
    if how == "logout":
        r = await gw.post("/api/identity/auth/logout", headers=v.auth)
        assert r.status_code == 204, r.text
    elif how == "session_delete":
        r = await gw.delete(f"/api/identity/sessions/{v.session_id}", headers=v.auth)
        assert r.status_code == 204, r.text
    elif how == "refresh_reuse":
        form = {"grant_type": "refresh_token", "refresh_token": v.refresh_token}
        assert (await gw.post("/api/identity/auth/token", data=form)).status_code == 200
        r = await gw.post("/api/identity/auth/token", data=form)  # spent: reuse revokes the session
        assert r.status_code == 401 and r.json()["code"] == "refresh_token_reused", r.text
    elif how == "user_disabled":
        r = await gw.post(f"/api/identity/users/{v.user_id}/disable")
        assert r.status_code == 200, r.text
    elif how == "membership_removed":
        r = await gw.delete(f"/api/identity/memberships/{v.membership_id}")
        assert r.status_code == 204, r.text
    elif how == "token_expiry":
        await asyncio.sleep(max(0.0, v.expires_at - time.time()))
        return time.monotonic() - max(0.0, time.time() - v.expires_at)
    else:
        raise ValueError(how)
    return time.monotonic()


def services_t0(how: str, t0: float) -> float:
    """When the services should refuse: at once, except that an expired token is still accepted for the
    verifier's clock-skew leeway (streams close at `exp` itself)."""
    return t0 + CLOCK_SKEW_LEEWAY_S if how == "token_expiry" else t0


async def run_trial(gw: httpx.AsyncClient, w: World, how: str, *, deadline_s: float = 15.0, ssh: bool = False) -> Trial:
    """One viewer, its streams, one revocation; every service polled until it refuses, every stream until it
    closes (or `deadline_s`). With `ssh` (for SSH_REVOCATIONS) also an SSH session and a new SSH login."""
    v = await new_viewer(gw, w)
    ssh_probe = await open_ssh(gw, w, v) if ssh and how in SSH_REVOCATIONS else None
    probes = await open_streams(w, v)
    if ssh_probe is not None:
        probes["ssh_session"] = ssh_probe.stream
    trial = Trial(how)
    checks = service_checks(w, include_user_level=how != "membership_removed")
    try:
        t0 = await revoke(gw, v, how)
        ts = services_t0(how, t0)

        async def until_refused(name: str, method: str, path: str) -> None:
            while time.monotonic() - ts < deadline_s:
                r = await _call(gw, method, path, v.auth)
                if r.status_code in (401, 403, 404):
                    code = (
                        r.json().get("code", "")
                        if r.headers.get("content-type", "").startswith("application/problem+json")
                        else f"not problem+json: {r.headers.get('content-type')}"
                    )
                    trial.refused[name] = (time.monotonic() - ts, r.status_code, code)
                    return
                await asyncio.sleep(POLL_S)

        async def until_ssh_refused(p: SshProbe) -> None:
            import asyncssh

            while time.monotonic() - t0 < deadline_s:
                try:
                    (await _ssh_connect(p.endpoint, p.key)).close()
                except asyncssh.PermissionDenied:
                    trial.refused["ssh-login"] = (time.monotonic() - t0, 0, "permission_denied")
                    return
                await asyncio.sleep(POLL_S)

        await asyncio.gather(
            *(until_refused(n, m, p) for n, (m, p) in checks.items()),
            *([until_ssh_refused(ssh_probe)] if ssh_probe else []),
        )
        remaining = max(0.1, deadline_s - (time.monotonic() - t0))
        await asyncio.wait([p.task for p in probes.values() if p.task], timeout=remaining)
        for p in probes.values():
            if p.closed_at is not None:
                trial.closed[p.name] = (p.closed_at - t0, p.how)
    finally:
        for p in probes.values():
            if p.task and not p.task.done():
                p.task.cancel()
                with contextlib.suppress(BaseException):
                    await p.task
    return trial


def summary(trial: Trial) -> str:
    return json.dumps({"refused": trial.refused, "closed": trial.closed}, default=str)
