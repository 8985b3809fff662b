"""Real servers on loopback ports: small upstream FastAPI apps, a JWKS app, and the gateway itself
(uvicorn in this process, same event loop). Everything is per test: no shared state."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request, Response, WebSocket
from fastapi.responses import JSONResponse, StreamingResponse
from joserfc import jwt
from joserfc.jwk import ECKey
from pydantic import BaseModel

from gpuaas.gateway.app import create_app, server_config
from gpuaas.gateway.settings import Settings

ISSUER = "http://gateway.test/api/identity"
AUDIENCE = "gpuaas"


class _Server(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Iterator[None]:  # several servers in one process: leave signals alone
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Servers:
    """uvicorn servers on fresh loopback ports, in this event loop; stopped together (in parallel)."""

    def __init__(self) -> None:
        self._running: list[tuple[_Server, asyncio.Task[None], socket.socket]] = []

    async def start(self, config: uvicorn.Config) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = _Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        self._running.append((server, task, sock))
        deadline = time.monotonic() + 10
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("server exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            await asyncio.sleep(0.01)
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        for server, _, _ in self._running:
            server.should_exit = True
        tasks = [task for _, task, _ in self._running]
        _, pending = await asyncio.wait(tasks, timeout=5) if tasks else (set(), set())
        for server, _, _ in self._running:
            server.force_exit = True
        if pending:
            await asyncio.wait(pending, timeout=5)
        for _, task, sock in self._running:
            if not task.done():
                task.cancel()
            sock.close()
        self._running.clear()


def plain_config(app: FastAPI) -> uvicorn.Config:
    return uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=1)


@dataclass
class Issuer:
    """Signs tokens; its public keys are what the JWKS app serves (read live, so rotation shows)."""

    keys: list[ECKey] = field(default_factory=list)

    def add_key(self, kid: str) -> ECKey:
        key = ECKey.generate_key("P-256", parameters={"kid": kid, "alg": "ES256", "use": "sig"})
        self.keys.append(key)
        return key

    def jwks(self) -> dict[str, Any]:
        return {"keys": [k.as_dict(private=False) for k in self.keys]}

    def token(
        self,
        *,
        kid: str = "k1",
        sub: uuid.UUID | None = None,
        exp_in: int = 300,
        key: ECKey | None = None,
        **claims: Any,
    ) -> str:
        signing_key = key or next(k for k in self.keys if k.kid == kid)
        now = int(time.time())
        body = {
            "sub": str(sub or uuid.uuid4()),
            "typ": "user",
            "iss": ISSUER,
            "aud": AUDIENCE,
            "iat": now,
            "exp": now + exp_in,
        } | claims
        return jwt.encode({"alg": "ES256", "kid": signing_key.kid}, body, signing_key)


class FakeClock:
    """Monotonic seconds that move only when a test moves them."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Stack:
    issuer: Issuer
    jwks_url: str
    identity: FastAPI
    catalog: FastAPI
    identity_url: str
    catalog_url: str
    down_url: str  # nothing listens there
    servers: Servers

    def settings(self, **overrides: Any) -> Settings:
        values: dict[str, Any] = {
            "upstreams": {"identity": self.identity_url, "catalog": self.catalog_url, "billing": self.down_url},
            "jwks_url": self.jwks_url,
            "jwt_issuer": ISSUER,
            "jwt_audience": AUDIENCE,
            "log_json": True,
            "upstream_connect_timeout_s": 2.0,
            "console_dir": "",  # the placeholder page unless a test serves a console build
        } | overrides
        return Settings(**values)

    async def gateway(self, clock: Callable[[], float] = time.monotonic, **overrides: Any) -> str:
        """Start a gateway (stopped at the end of the test); returns its base URL. `clock` drives its
        rate limiter (a `FakeClock` makes the buckets refill only when the test says so)."""
        settings = self.settings(**overrides)
        return await self.servers.start(server_config(create_app(settings, clock=clock), settings))

    def bearer(self, **claims: Any) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.issuer.token(**claims)}"}


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    issuer = Issuer()
    issuer.add_key("k1")
    identity, catalog = make_upstream("identity"), make_upstream("catalog")
    servers = Servers()
    try:
        jwks_url = await servers.start(plain_config(make_jwks_app(issuer.jwks)))
        identity_url = await servers.start(plain_config(identity))
        catalog_url = await servers.start(plain_config(catalog))
        yield Stack(
            issuer=issuer,
            jwks_url=f"{jwks_url}/.well-known/jwks.json",
            identity=identity,
            catalog=catalog,
            identity_url=identity_url,
            catalog_url=catalog_url,
            down_url=f"http://127.0.0.1:{free_port()}",
            servers=servers,
        )
    finally:
        await servers.stop()


@pytest.fixture
async def gateway(stack: Stack) -> str:
    return await stack.gateway()


async def _eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@pytest.fixture(name="free_port")
def _free_port_fixture() -> Callable[[], int]:
    return free_port


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def eventually() -> Callable[..., Any]:
    return _eventually


# --- the upstream apps -------------------------------------------------------------------------


def make_jwks_app(jwks: Callable[[], dict[str, Any]]) -> FastAPI:
    app = FastAPI()
    app.state.fetches = 0

    @app.get("/.well-known/jwks.json")
    async def keys() -> dict[str, Any]:
        app.state.fetches += 1
        return jwks()

    return app


def make_upstream(name: str) -> FastAPI:
    """A stand-in service. Both instances have a model called `Item` (different fields) to test
    that the aggregated OpenAPI keeps them apart."""
    app = FastAPI(title=f"test {name}", version=f"1.0-{name}", description=f"The {name} stand-in.", openapi_url=None)
    app.state.openapi_fetches = 0
    app.state.sse_finished = False  # the event stream ran to its end
    app.state.sse_closed = False  # the event stream's generator has ended: finished, or stopped by a disconnect
    app.state.ws_closes = []
    app.state.uploaded = []

    if name == "identity":

        class Item(BaseModel):
            id: int
            owner: str

    else:

        class Item(BaseModel):
            id: int
            price: float

    class Page(BaseModel):
        items: list[Item]

    @app.get("/items/{item_id}", tags=["items"], response_model=Item)
    async def get_item(item_id: int) -> Any:
        return {"id": item_id, "owner": "x", "price": 1.0}

    @app.get("/items", tags=["items"], response_model=Page)
    async def list_items() -> Any:
        return {"items": []}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        app.state.openapi_fetches += 1
        return app.openapi()

    @app.api_route("/echo", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    async def echo(request: Request) -> dict[str, Any]:
        body = await request.body()
        headers: dict[str, list[str]] = {}
        for k, v in request.headers.raw:
            headers.setdefault(k.decode().lower(), []).append(v.decode())
        return {
            "method": request.method,
            "path": request.url.path,
            "raw_path": request.scope["raw_path"].decode(),
            "query": request.scope["query_string"].decode(),
            "headers": headers,
            "body": body.decode(errors="replace"),
        }

    @app.get("/auth/login")
    async def login(request: Request) -> dict[str, Any]:
        return {"public": True, "authorization": request.headers.get("authorization")}

    @app.get("/teapot")
    async def teapot() -> Response:
        resp = JSONResponse({"short": "and stout"}, status_code=418, headers={"X-Upstream": name})
        resp.raw_headers.append((b"set-cookie", b"a=1; Path=/"))
        resp.raw_headers.append((b"set-cookie", b"b=2; Path=/"))
        return resp

    @app.get("/slow")
    async def slow() -> dict[str, bool]:
        await asyncio.sleep(3)
        return {"slow": True}

    @app.post("/upload")
    async def upload(request: Request) -> dict[str, int]:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
        app.state.uploaded.append(size)
        return {"received": size}

    @app.get("/events/stream")
    async def events(request: Request) -> StreamingResponse:
        query = request.query_params

        async def gen() -> AsyncIterator[bytes]:
            try:
                yield b"event: hello\ndata: " + (request.headers.get("authorization") or "").encode() + b"\n\n"
                yield b"data: query=" + request.scope["query_string"] + b"\n\n"
                for i in range(int(query.get("n", "3"))):
                    await asyncio.sleep(float(query.get("gap", "0.4")))
                    yield f"id: {i}\ndata: tick {i}\n\n".encode()
                app.state.sse_finished = True
            finally:  # also on cancellation or close (GeneratorExit), when the server stops the stream
                app.state.sse_closed = True

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> dict[str, bool]:
        return {"ready": True}

    @app.websocket("/ws/{kind}")
    async def ws(websocket: WebSocket, kind: str) -> None:
        offered = websocket.scope.get("subprotocols", [])
        await websocket.accept(subprotocol=offered[0] if offered else None)
        await websocket.send_json(
            {
                "kind": kind,
                "authorization": websocket.headers.get("authorization"),
                "correlation_id": websocket.headers.get("x-correlation-id"),
                "forwarded_for": websocket.headers.get("x-forwarded-for"),
                "query": websocket.scope["query_string"].decode(),
                "subprotocol": offered[0] if offered else None,
            }
        )
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                app.state.ws_closes.append((message.get("code"), message.get("reason")))
                return
            if (text := message.get("text")) is not None:
                if text == "crash":
                    raise RuntimeError("upstream crashed")  # uvicorn drops the TCP connection, no close frame
                if text.startswith("close:"):
                    _, code, reason = text.split(":", 2)
                    await websocket.close(int(code), reason)
                    return
                await websocket.send_text(f"echo:{text}")
            elif (data := message.get("bytes")) is not None:
                await websocket.send_bytes(data[::-1])

    return app
