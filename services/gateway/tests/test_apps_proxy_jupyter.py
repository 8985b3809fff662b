"""The `/apps/{instance_id}/` proxy in front of the real JupyterLab workload (issue 21): the `gpuaas-jupyter`
runtime image in a podman container, started as the node agent starts it (its command, the published port,
the per-instance secret in JUPYTER_TOKEN), behind a gateway whose app-runtime is a stand-in answering
`/instances/{id}/workload` (+ `/open`, `/watch`) with that container's loopback port.

A kernel is driven through the proxy as JupyterLab does: POST /api/sessions, then the kernel's channels
WebSocket with `session_id`, the browser's Origin and cookies (the admission cookie, Jupyter's own), in the
v1 binary protocol (`v1.kernel.websocket.jupyter.org`) and in the legacy JSON one; an `execute_request`
for `6*7` must come back as `execute_result` 42, and the socket must stay open (no reconnect loop).
Then JupyterLab itself in headless Chromium through the proxy (web/console/tests/jupyter.e2e.mjs, the e2e
test's browser script): a notebook from the launcher, a cell run, its output read back.
Skipped without podman or the image (`make runtime-images`); the Chromium test also without node.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gpuaas.contracts.events.allocations import WorkloadSpec
from gpuaas.kit import workload_tokens

from .conftest import Stack, plain_config

IMAGE = "localhost/gpuaas/runtimes/gpuaas-jupyter:1.0.0"
V1 = "v1.kernel.websocket.jupyter.org"
ROOT = Path(__file__).resolve().parents[3]
CONTAINERS_CONF = ROOT / "deploy" / "local" / "containers.conf"
KEY = "c1b-test-workload-token-key-0123456789abcdef"
# The catalog's jupyter runtime_profile command (deploy/images/runtimes/gpuaas-jupyter.toml).
COMMAND = [
    "/opt/gpuaas/venv/bin/jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--no-browser",
    "--ServerApp.base_url={base_path}", "--ServerApp.allow_origin=*", "--ServerApp.root_dir=.",
    "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
]  # fmt: skip


def _podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    return subprocess.run(["podman", *args], env=env, capture_output=True, text=True, check=check, timeout=120)


def _image_present() -> bool:
    return shutil.which("podman") is not None and _podman("image", "exists", IMAGE, check=False).returncode == 0


pytestmark = pytest.mark.skipif(not _image_present(), reason=f"needs podman and {IMAGE} (make runtime-images)")


class Workload:
    def __init__(self, instance_id: uuid.UUID, port: int, name: str) -> None:
        self.instance_id, self.port, self.name = instance_id, port, name
        self.base_path = f"/apps/{instance_id}/"


@pytest.fixture(scope="module")
def workload() -> Iterator[Workload]:
    """JupyterLab as the node agent runs it (node_agent.workload: gpuaas-init, then the user's command)."""
    from gpuaas.node_agent import workload as agent_workload

    iid = uuid.uuid4()
    spec = WorkloadSpec(
        instance_id=iid,
        command=COMMAND,
        port=8888,
        base_path=f"/apps/{iid}/",
        auth_env="JUPYTER_TOKEN",
        health_path="/api/status",
    )
    secret = workload_tokens.derive(KEY.encode(), iid)
    name = f"c1b-jupyter-{iid.hex[:8]}"
    args = agent_workload.container_args(spec, secret, "127.0.0.1", "c1b")
    _podman("run", "-d", "--rm", "--name", name, *args, IMAGE, *agent_workload.command(spec, "c1b", 1000))
    try:
        port = int(_podman("port", name, "8888/tcp").stdout.strip().rsplit(":", 1)[1])
        url = agent_workload.health_url(spec, "127.0.0.1", port)
        headers = agent_workload.auth_headers(spec, secret)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url, headers=headers, timeout=3, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"jupyter did not start: {_podman('logs', name, check=False).stderr[-3000:]}")
            time.sleep(0.5)
        yield Workload(iid, port, name)
    finally:
        _podman("rm", "-f", "-t", "2", name, check=False)


def make_app_runtime(w: Workload) -> FastAPI:
    """app-runtime's three workload routes for one running instance (every caller admitted)."""
    app = FastAPI()
    app.state.opens = 0
    app.state.watches = 0
    app.state.revoked = False  # True: the caller is no longer a member (app-runtime answers 404)
    answer = {
        "instance_id": str(w.instance_id),
        "project_id": str(uuid.uuid4()),
        "host": "127.0.0.1",
        "port": w.port,
        "base_path": w.base_path,
        "auth_header": "Authorization",
        "auth_scheme": "token",
        "authenticated": True,
    }

    gone = {"status": 404, "code": "instance_not_found", "detail": "no such instance"}

    def answer_or_404() -> Any:
        return JSONResponse(gone, status_code=404) if app.state.revoked else answer

    @app.get("/instances/{iid}/workload")
    async def get(iid: uuid.UUID) -> Any:
        return answer_or_404()

    @app.post("/instances/{iid}/workload/open")
    async def open_(iid: uuid.UUID) -> Any:
        app.state.opens += 1
        return answer_or_404()

    @app.get("/instances/{iid}/workload/watch")
    async def watch(iid: uuid.UUID, request: Request) -> EventSourceResponse:
        app.state.watches += 1

        async def events() -> AsyncIterator[dict[str, str]]:
            yield {"event": "open", "data": json.dumps(answer)}
            while not await request.is_disconnected():
                if app.state.revoked:  # what gpuaas.kit.revocation sends when the re-check fails
                    yield {"event": "access_revoked", "data": json.dumps(gone)}
                    return
                await asyncio.sleep(0.1)

        return EventSourceResponse(events(), ping=10)

    return app


@pytest.fixture
async def proxy(stack: Stack, workload: Workload, monkeypatch: pytest.MonkeyPatch) -> tuple[str, FastAPI]:
    monkeypatch.setenv(workload_tokens.ENV, KEY)
    app_runtime = make_app_runtime(workload)
    url = await stack.servers.start(plain_config(app_runtime))
    settings = stack.settings()
    gateway = await stack.gateway(upstreams={**settings.upstreams, "app-runtime": url})
    return gateway, app_runtime


# ------------------------------------------------------------------------------ the kernel protocols


def _execute(code: str, session: str) -> dict[str, Any]:
    return {
        "channel": "shell",
        "header": {
            "msg_id": uuid.uuid4().hex,
            "msg_type": "execute_request",
            "username": "c1b",
            "session": session,
            "version": "5.3",
            "date": "",
        },
        "parent_header": {},
        "metadata": {},
        "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {}},
        "buffers": [],
    }


def _v1_pack(msg: dict[str, Any]) -> bytes:
    """JupyterLab's v1 framing: offsets (u64 LE), the channel, then header/parent/metadata/content JSON."""
    parts = [msg["channel"].encode()] + [
        json.dumps(msg[k]).encode() for k in ("header", "parent_header", "metadata", "content")
    ]
    offsets, at = [], 8 * (len(parts) + 2)
    for p in parts:
        offsets.append(at)
        at += len(p)
    offsets.append(at)
    return struct.pack(f"<{len(offsets) + 1}Q", len(offsets), *offsets) + b"".join(parts)


def _v1_unpack(data: bytes) -> dict[str, Any]:
    n = struct.unpack("<Q", data[:8])[0]
    offsets = struct.unpack(f"<{n}Q", data[8 : 8 + 8 * n])
    chunks = [data[offsets[i] : offsets[i + 1]] for i in range(n - 1)]
    header, parent, _metadata, content = (json.loads(c) for c in chunks[1:5])
    return {"channel": chunks[0].decode(), "header": header, "parent_header": parent, "content": content}


async def _result_of(ws: ClientConnection, msg_id: str, v1: bool) -> str:
    async with asyncio.timeout(60):
        while True:
            raw = await ws.recv()
            msg = _v1_unpack(raw) if v1 else json.loads(raw)
            if msg["header"]["msg_type"] == "execute_result" and msg["parent_header"].get("msg_id") == msg_id:
                return str(msg["content"]["data"]["text/plain"])


async def _browser_session(gateway: str, w: Workload, token: str) -> tuple[dict[str, str], str]:
    """What the browser holds after opening the app: the admission cookie and Jupyter's own cookies (_xsrf,
    its user cookie); then a notebook session (kernel) created as JupyterLab does (XSRF header + cookie)."""
    async with httpx.AsyncClient(base_url=gateway, timeout=60, follow_redirects=False) as c:
        r = await c.get(f"{w.base_path}?access_token={token}")
        assert r.status_code == 303, r.text
        r = await c.get(f"{w.base_path}lab")
        assert r.status_code == 200, r.text
        xsrf = c.cookies.get("_xsrf")
        assert xsrf, dict(c.cookies)
        r = await c.post(
            f"{w.base_path}api/sessions",
            json={"path": "c1b.ipynb", "name": "c1b.ipynb", "type": "notebook", "kernel": {"name": "python3"}},
            headers={"X-XSRFToken": xsrf, "Origin": gateway},
        )
        assert r.status_code == 201, r.text
        cookies = {name: value for name, value in c.cookies.items()}
        return cookies, str(r.json()["kernel"]["id"])


@pytest.mark.parametrize("protocol", ["v1", "json"])
async def test_kernel_executes_through_the_proxy(stack: Stack, workload: Workload, proxy: Any, protocol: str) -> None:
    gateway, app_runtime = proxy
    cookies, kernel = await _browser_session(gateway, workload, stack.issuer.token())
    session = uuid.uuid4().hex
    url = (
        "ws" + gateway.removeprefix("http") + f"{workload.base_path}api/kernels/{kernel}/channels?session_id={session}"
    )
    headers = {"Origin": gateway, "Cookie": "; ".join(f"{k}={v}" for k, v in cookies.items())}
    v1 = protocol == "v1"
    async with connect(url, additional_headers=headers, subprotocols=[V1] if v1 else None, open_timeout=90) as ws:
        assert ws.subprotocol == (V1 if v1 else None)
        for code, want in (("6*7", "42"), ("sum(i * i for i in range(10)) * 2", "570")):
            msg = _execute(code, session)
            await ws.send(_v1_pack(msg) if v1 else json.dumps(msg))
            assert await _result_of(ws, msg["header"]["msg_id"], v1) == want
        # Still the same socket a while later: nothing closed it (the browser would reconnect).
        await asyncio.sleep(2)
        msg = _execute("7*6", session)
        await ws.send(_v1_pack(msg) if v1 else json.dumps(msg))
        assert await _result_of(ws, msg["header"]["msg_id"], v1) == "42"
    assert app_runtime.state.opens >= 2  # the page's token exchange and the WebSocket were audited
    assert app_runtime.state.watches == 1  # one watch per proxied WebSocket


async def test_revoked_caller_kernel_socket_closed_and_next_request_refused(
    stack: Stack, workload: Workload, proxy: Any
) -> None:
    gateway, app_runtime = proxy
    bearer = {"Authorization": f"Bearer {stack.issuer.token()}"}
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as c:
        r = await c.post(f"{workload.base_path}api/kernels", json={"name": "python3"}, headers=bearer)
        assert r.status_code == 201, r.text
        kernel = r.json()["id"]
        url = "ws" + gateway.removeprefix("http") + f"{workload.base_path}api/kernels/{kernel}/channels"
        async with connect(url, additional_headers=bearer, open_timeout=90) as ws:
            msg = _execute("6*7", uuid.uuid4().hex)
            await ws.send(json.dumps(msg))
            assert await _result_of(ws, msg["header"]["msg_id"], v1=False) == "42"
            assert (await c.get(f"{workload.base_path}api/status", headers=bearer)).status_code == 200  # cached
            app_runtime.state.revoked = True
            with pytest.raises(ConnectionClosed) as closed:
                async with asyncio.timeout(10):
                    while True:
                        await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404, closed.value
        # Refused at once, not after the lookup cache's 2 s: the close dropped the cached admission.
        r = await c.get(f"{workload.base_path}api/status", headers=bearer)
        assert r.status_code == 404, r.text


async def test_workload_refusing_the_upgrade_is_passed_on(stack: Stack, workload: Workload, proxy: Any) -> None:
    gateway, _ = proxy
    bearer = {"Authorization": f"Bearer {stack.issuer.token()}"}
    url = "ws" + gateway.removeprefix("http") + f"{workload.base_path}api/kernels/{uuid.uuid4()}/channels"
    with pytest.raises(InvalidStatus) as refused:  # Jupyter's 404 for an unknown kernel, not a gateway error
        async with connect(url, additional_headers=bearer, open_timeout=30):
            pass
    assert refused.value.response.status_code == 404


CONSOLE = ROOT / "web" / "console"


@pytest.mark.skipif(
    shutil.which("node") is None or not (CONSOLE / "node_modules" / "playwright-core").exists(),
    reason="needs node and web/console's playwright-core",
)
async def test_jupyterlab_in_chromium_through_the_proxy(
    stack: Stack, workload: Workload, proxy: Any, tmp_path: Path
) -> None:
    gateway, _ = proxy
    env = {
        **os.environ,
        "CHROMIUM": os.environ.get("GPUAAS_CHROMIUM", "/usr/bin/chromium"),
        "GATEWAY_URL": gateway,
        "INSTANCE_ID": str(workload.instance_id),
        "ACCESS_TOKEN": stack.issuer.token(exp_in=900),
        "SCREENSHOT_DIR": str(tmp_path),
        "STEP_TIMEOUT_MS": "60000",
    }
    proc = await asyncio.create_subprocess_exec(
        "node", "tests/jupyter.e2e.mjs", cwd=CONSOLE, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = (b.decode() for b in await asyncio.wait_for(proc.communicate(), 400))
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no result (rc {proc.returncode}): {out[-3000:]} {err[-3000:]}"
    result = json.loads(lines[-1])
    assert proc.returncode == 0 and result["ok"], json.dumps(result, indent=1)[-6000:]
    assert result["output"] == "570"
    print(f"chromium_run_attempts={result['runAttempts']}")  # >1: JupyterLab skipped an early run
