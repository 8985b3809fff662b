"""`/apps/{instance_id}/...`: a launchable app's workload (e.g. JupyterLab) in the browser (issue 21).

Admission is the platform's own sign-in, never the app's: a bearer token (CLI), or the console's access token
given once as `?access_token=` — then kept in an HttpOnly cookie (SameSite=Strict; Lax on the app's own origin,
below) scoped to this instance's path (lifetime: the token's) and the browser is sent on without it (303). When
that cookie has expired (or is missing), a page navigation is sent to the console's
`#/instances/{id}/reopen?path=...`, which signs in again with the console session (refreshing its token) and comes
back here with a fresh token; any other request gets the 401 (JupyterLab's own calls: its next page load
recovers). For every request the gateway asks app-runtime, WITH THE CALLER'S TOKEN, where this instance's workload
may be reached for this caller (`GET /instances/{id}/workload`: 404 outside the project, 403 without
`apps.instance.open`, 409 while not running; answers cached `APPS_LOOKUP_TTL_S` per token and instance). The
answer names the enrolled host's address and the port the node agent published — never anything from the request.

Upstream, the caller's platform token and the admission cookie are removed and the workload's per-instance
secret (`gpuaas.kit.workload_tokens`, HMAC of the instance id) is added in the header the manifest names:
the workload refuses everything without it, so it is reachable only through this path, and the user never
handles an app token. Opening a page with a token and every WebSocket are audited by app-runtime
(`POST .../workload/open`). Each proxied WebSocket runs beside app-runtime's `.../workload/watch` stream
(`gpuaas.kit.revocation`'s re-checks): when that stream ends — membership or role revoked, session revoked,
token expired, instance stopped — the WebSocket is closed (4401 token, 4403 role, 4404 no longer visible to
the caller, e.g. a removed member, 4409 not running).

With an apps domain set (app_origins.py), each app is served on its own origin `{id}.<apps domain>`: a browser
on another host is sent there (307), an app host serves only its own app, and a request from another origin
(`Origin` header) is refused, so an app's pages cannot use the console's session or another app's cookie.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode

import httpx
from fastapi import APIRouter, Request, Response, WebSocket
from fastapi.responses import RedirectResponse
from starlette.background import BackgroundTask
from starlette.websockets import WebSocketDisconnect
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidHandshake, InvalidStatus, InvalidURI
from websockets.typing import Subprotocol

from gpuaas.gateway.app_origins import AppOrigins
from gpuaas.gateway.edge import (
    HOP_BY_HOP,
    client_ip,
    downstream_response_headers,
    is_forwarding_header,
    render_problem,
)
from gpuaas.gateway.runtime import GatewayRuntime, runtime
from gpuaas.kit import workload_tokens
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Forbidden, NotFound, Problem, Unauthorized, Unavailable
from gpuaas.kit.logging import get_logger

log = get_logger(__name__)
router = APIRouter()

COOKIE = "gpuaas_app_session"
APPS_LOOKUP_TTL_S = 2.0
WS_OPEN_TIMEOUT_S = 90.0
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
# Never forwarded to a workload: the platform credentials and what the gateway sets itself.
_DROP_UP = HOP_BY_HOP | {"authorization", "cookie", "host", "content-length", "x-forwarded-for", "x-correlation-id"}
_WS_DROP = {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions", "sec-websocket-protocol"}
CLOSE_FOR_STATUS = {401: 4401, 403: 4403, 404: 4404, 409: 4409}


class WorkloadUnavailable(Problem):
    status, code, title = 502, "workload_unavailable", "App unavailable"


@dataclass(frozen=True)
class Upstream:
    host: str
    port: int
    base_path: str
    header: str
    value: str | None  # the header value carrying the secret; None: the workload takes no secret

    def url(self, scheme: str, rest: str, query: str) -> str:
        return f"{scheme}://{self.host}:{self.port}{self.base_path}{rest}" + (f"?{query}" if query else "")


@dataclass
class Admission:
    token: str
    principal: Principal
    from_query: bool


# ------------------------------------------------------------------------------------------- admission


def _instance_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise NotFound("No app at this path.", code="not_found") from None


async def _admit(
    rt: GatewayRuntime, headers: Mapping[str, str], query: Mapping[str, str], cookies: Mapping[str, str]
) -> Admission:
    scheme, _, value = headers.get("authorization", "").partition(" ")
    token, from_query = None, False
    if scheme.lower() == "bearer" and value.strip():
        token = value.strip()
    elif query.get("access_token"):
        token, from_query = query["access_token"], True
    elif cookies.get(COOKIE):
        token = cookies[COOKIE]
    if not token:
        raise Unauthorized("Sign in to the console and open the app from there.", code="missing_token")
    try:
        principal = await rt.verifier.verify(token)
    except Unavailable as exc:
        raise Unavailable(
            "Token keys cannot be fetched from identity; retry shortly.", code="auth_unavailable"
        ) from exc
    except Unauthorized:
        rt.metrics.auth_rejected.labels("apps").inc()
        raise
    decision = rt.limiter.take(f"sub:{principal.subject}")
    if not decision.allowed:
        raise Problem("Rate limit exceeded.", code="rate_limited", status=429)
    return Admission(token, principal, from_query)


_lookups: dict[tuple[str, uuid.UUID], tuple[float, Upstream]] = {}


def _lookup_key(token: str, instance_id: uuid.UUID) -> tuple[str, uuid.UUID]:
    return hashlib.sha256(token.encode()).hexdigest(), instance_id


async def _upstream(rt: GatewayRuntime, admission: Admission, instance_id: uuid.UUID, *, audit: bool) -> Upstream:
    """app-runtime's answer for this caller (with the caller's token), cached briefly unless audited."""
    key = _lookup_key(admission.token, instance_id)
    hit = _lookups.get(key)
    if hit is not None and not audit and hit[0] > time.monotonic():
        return hit[1]
    app_runtime = rt.upstreams.get("app-runtime")
    if app_runtime is None:
        raise WorkloadUnavailable("app-runtime is not configured.")
    path = f"/instances/{instance_id}/workload" + ("/open" if audit else "")
    try:
        r = await rt.client.request(
            "POST" if audit else "GET",
            app_runtime.base_url + path,
            headers={"authorization": f"Bearer {admission.token}"},
            timeout=rt.settings.upstream_timeout_s,
        )
    except httpx.HTTPError as exc:
        raise WorkloadUnavailable("app-runtime is unavailable.") from exc
    if r.status_code != 200:
        body = _problem_body(r)
        raise Problem(
            body.get("detail") or "The app cannot be opened.",
            code=body.get("code") or "app_unavailable",
            status=r.status_code if 400 <= r.status_code < 500 else 502,
        )
    data = r.json()
    secret = workload_tokens.derive(workload_tokens.key_from_env(), instance_id) if data.get("authenticated") else None
    scheme = str(data.get("auth_scheme") or "")
    upstream = Upstream(
        host=str(data["host"]),
        port=int(data["port"]),
        base_path=str(data["base_path"]),
        header=str(data.get("auth_header") or "Authorization").lower(),
        value=(f"{scheme} {secret}".strip() if secret else None),
    )
    if len(_lookups) > 10_000:
        _lookups.clear()
    _lookups[key] = (time.monotonic() + APPS_LOOKUP_TTL_S, upstream)
    return upstream


def _problem_body(r: httpx.Response) -> dict[str, Any]:
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _upstream_headers(
    raw: list[tuple[bytes, bytes]], up: Upstream, peer_ip: str, drop: set[str] | frozenset[str]
) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for k, v in raw:
        name = k.decode("latin-1").lower()
        if name in _DROP_UP or name in drop or name == up.header or is_forwarding_header(name):
            continue  # a client's own X-Forwarded-*/Forwarded never reach the workload (issue 28)
        out.append((name, v.decode("latin-1")))
    cookies = [c for c in _cookie_pairs(raw) if not c.startswith(f"{COOKIE}=")]
    if cookies:
        out.append(("cookie", "; ".join(cookies)))
    out.append(("x-forwarded-for", peer_ip))
    if up.value:
        out.append((up.header, up.value))
    return out


def _cookie_pairs(raw: list[tuple[bytes, bytes]]) -> list[str]:
    pairs: list[str] = []
    for k, v in raw:
        if k.lower() == b"cookie":
            pairs += [p.strip() for p in v.decode("latin-1").split(";") if p.strip()]
    return pairs


def _query_without_token(query: str) -> str:
    return urlencode([(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k != "access_token"])


# ------------------------------------------------------------------------------------------------ HTTP


@router.api_route("/apps/{instance_id}", methods=METHODS, include_in_schema=False)
async def app_root(instance_id: str, request: Request) -> Response:
    query = request.url.query
    return RedirectResponse(f"/apps/{instance_id}/" + (f"?{query}" if query else ""), status_code=308)


@router.api_route("/apps/{instance_id}/{rest:path}", methods=METHODS, include_in_schema=False)
async def app_http(instance_id: str, rest: str, request: Request) -> Response:
    rt = runtime(request)
    path = request.url.path
    try:
        iid = _instance_id(instance_id)
        if rt.app_origins is not None:
            if _bound_for_own_origin(rt.app_origins, request.headers):
                query = request.url.query
                target = rt.app_origins.origin_of(iid) + path + (f"?{query}" if query else "")
                return RedirectResponse(target, status_code=307, headers={"cache-control": "no-store"})
            _check_origin(rt.app_origins, iid, request.headers)
        admission = await _admit(rt, request.headers, request.query_params, request.cookies)
        up = await _upstream(rt, admission, iid, audit=admission.from_query)
    except Problem as exc:
        if exc.status == 401 and _navigation(request) and "access_token" not in request.query_params:
            return _reopen_through_console(rt.app_origins, instance_id, rest, request.url.query)
        return render_problem(exc, path)
    if admission.from_query:  # keep the token in a cookie for this app's path only, and drop it from the URL
        query = _query_without_token(request.url.query)
        response = RedirectResponse(path + (f"?{query}" if query else ""), status_code=303)
        max_age = max(1, int((admission.principal.expires_at or time.time() + 60) - time.time()))
        response.set_cookie(
            COOKIE,
            admission.token,
            max_age=max_age,
            path=f"/apps/{iid}/",
            httponly=True,
            # On its own origin the app is another site than the console that links to it: Lax lets that
            # top-level navigation carry the cookie; other sites' requests are refused by their Origin.
            samesite="strict" if rt.app_origins is None else "lax",
            secure=request.url.scheme == "https",
        )
        return response
    peer = client_ip(request.client.host if request.client else None, None, ())
    outbound = rt.client.build_request(
        request.method,
        up.url("http", rest, _query_without_token(request.url.query)),
        headers=_upstream_headers(list(request.scope["headers"]), up, peer, set()),
        content=request.stream() if request.method not in ("GET", "HEAD") else None,
        timeout=httpx.Timeout(
            rt.settings.upstream_timeout_s, connect=rt.settings.upstream_connect_timeout_s, read=None
        ),
    )
    try:
        resp = await rt.client.send(outbound, stream=True)
    except httpx.HTTPError as exc:
        log.warning("app_workload_unavailable", instance_id=str(iid), error=repr(exc))
        return render_problem(WorkloadUnavailable("The app does not answer."), path)
    log.info(
        "app_proxied", method=request.method, path=path, status=resp.status_code, actor=str(admission.principal.subject)
    )
    response = _Relay(resp)
    response.raw_headers = downstream_response_headers(resp.headers.raw)
    return response


def _navigation(request: Request) -> bool:
    """A browser loading a page (not a script's call, which cannot follow a sign-in round trip)."""
    if request.method != "GET":
        return False
    mode = request.headers.get("sec-fetch-mode")
    return mode == "navigate" if mode else "text/html" in request.headers.get("accept", "")


def _bound_for_own_origin(origins: AppOrigins, headers: Mapping[str, str]) -> bool:
    """A browser's request for an app on another host (the console's): it goes to the app's own origin.
    A bearer token (CLI, SDK, scripts) is no ambient credential: such calls are served where they arrive."""
    bearer = headers.get("authorization", "").lower().startswith("bearer ")
    return not bearer and not origins.is_app_host(headers.get("host"))


def _check_origin(origins: AppOrigins, iid: uuid.UUID, headers: Mapping[str, str]) -> None:
    """Browsers name the page that made a request in `Origin` (every WebSocket, fetches other than GET):
    only the app's own pages may call it with the viewer's cookie."""
    if origins.is_app_host(headers.get("host")) and not origins.same_origin(iid, headers.get("origin")):
        raise Forbidden("Only the app's own pages may call it.", code="cross_origin_refused")


def _reopen_through_console(origins: AppOrigins | None, instance_id: str, rest: str, query: str) -> Response:
    """303 to the console, which gets a fresh token from its own session and comes back to this page. The
    path goes as a parameter the console checks stays under this app (no open redirect); the console comes
    back through its own origin's /apps/, which sends the browser on to the app's origin."""
    iid = _instance_id(instance_id)
    back = f"/apps/{iid}/{rest}" + (f"?{query}" if query else "")
    console = origins.console_url if origins is not None else ""
    response = RedirectResponse(f"{console}/#/instances/{iid}/reopen?{urlencode({'path': back})}", status_code=303)
    response.headers["cache-control"] = "no-store"
    return response


class _Relay(Response):
    def __init__(self, resp: httpx.Response) -> None:
        super().__init__(status_code=resp.status_code, background=BackgroundTask(resp.aclose))
        self._resp = resp

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self._resp.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if self.background is not None:
            await self.background()


# ------------------------------------------------------------------------------------------ WebSocket


@router.websocket("/apps/{instance_id}/{rest:path}")
async def app_websocket(websocket: WebSocket, instance_id: str, rest: str) -> None:
    from gpuaas.gateway.websocket import _bridge, _deny  # the /api bridge's pumps and refusal

    rt = runtime(websocket)
    path = websocket.url.path
    try:
        iid = _instance_id(instance_id)
        if rt.app_origins is not None:
            if _bound_for_own_origin(rt.app_origins, websocket.headers):
                raise Forbidden("Open the app on its own origin.", code="app_origin_required")
            _check_origin(rt.app_origins, iid, websocket.headers)
        admission = await _admit(rt, websocket.headers, websocket.query_params, websocket.cookies)
        up = await _upstream(rt, admission, iid, audit=True)
    except Problem as exc:
        await _deny(websocket, render_problem(exc, path))
        return
    peer = websocket.client.host if websocket.client else ""
    headers = _upstream_headers(list(websocket.scope["headers"]), up, peer, _WS_DROP)
    subprotocols = [Subprotocol(p) for p in websocket.scope.get("subprotocols", [])]
    try:
        upstream_ws = await connect(
            up.url("ws", rest, _query_without_token(websocket.url.query)),
            additional_headers=headers,
            subprotocols=subprotocols or None,
            user_agent_header=None if "user-agent" in websocket.headers else "gpuaas-gateway",
            # Jupyter answers a kernel's WebSocket handshake only once the kernel is ready (seconds, more on a
            # busy host): not the /api services' 10 s.
            open_timeout=WS_OPEN_TIMEOUT_S,
            max_size=rt.settings.ws_max_message_bytes,
            proxy=None,
        )
    except InvalidStatus as exc:  # the workload refused the upgrade (its body is a bytearray: copy it)
        refused = exc.response
        log.info("app_websocket_refused", path=path, status=refused.status_code)
        await _deny(websocket, Response(bytes(refused.body or b""), refused.status_code))
        return
    except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
        log.warning("app_workload_unavailable", instance_id=str(iid), error=repr(exc), websocket=True)
        await _deny(websocket, render_problem(WorkloadUnavailable("The app does not answer."), path))
        return
    await websocket.accept(subprotocol=upstream_ws.subprotocol)
    actor = str(admission.principal.subject)
    log.info("app_websocket_opened", path=path, subprotocol=upstream_ws.subprotocol, actor=actor)
    bridge = asyncio.create_task(_bridge(websocket, upstream_ws))
    watch = asyncio.create_task(_watch(rt, admission.token, iid))
    try:
        done, _ = await asyncio.wait({bridge, watch}, return_when=asyncio.FIRST_COMPLETED)
        if bridge in done:  # who closed, and with which code: a client that reconnects shows here
            closed_by, code = bridge.result()
            log.info("app_websocket_closed", path=path, closed_by=closed_by, code=code, actor=actor)
        else:  # access lost: close both sides
            code, reason = watch.result()
            log.info("app_websocket_revoked", path=path, code=code, reason=reason, actor=actor)
            # This process's cached admission goes too: the caller's next request asks app-runtime again.
            _lookups.pop(_lookup_key(admission.token, iid), None)
            bridge.cancel()
            with suppress(RuntimeError, OSError, WebSocketDisconnect):
                await websocket.close(code, reason[:120])
    finally:
        for task in (bridge, watch):
            task.cancel()
        await asyncio.gather(bridge, watch, return_exceptions=True)
        await upstream_ws.close(1001)


async def _watch(rt: GatewayRuntime, token: str, instance_id: uuid.UUID) -> tuple[int, str]:
    """Follow app-runtime's watch stream for this caller; return the close code once access is lost."""
    app_runtime = rt.upstreams["app-runtime"]
    url = f"{app_runtime.base_url}/instances/{instance_id}/workload/watch"
    while True:
        event = ""
        try:
            async with rt.client.stream(
                "GET",
                url,
                headers={"authorization": f"Bearer {token}", "accept": "text/event-stream"},
                timeout=httpx.Timeout(10.0, read=None),
            ) as r:
                if r.status_code != 200:
                    body = json.loads(await r.aread() or b"{}")
                    return CLOSE_FOR_STATUS.get(r.status_code, 4403), str(body.get("code") or r.status_code)
                async for line in r.aiter_lines():
                    if line.startswith("event:"):
                        event = line.split(":", 1)[1].strip()
                    elif line.startswith("data:") and event == "access_revoked":
                        body = json.loads(line.split(":", 1)[1])
                        return CLOSE_FOR_STATUS.get(int(body.get("status") or 403), 4403), str(body.get("code"))
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("app_watch_interrupted", instance_id=str(instance_id), error=repr(exc))
        await asyncio.sleep(1.0)  # the stream ended without a verdict (app-runtime restarted): follow again


class AppHostGuard:
    """ASGI middleware (installed with an apps domain): an app's host serves its own /apps/{id}/ only, so
    its pages can reach no console, API or other app on their origin. Other hosts pass through."""

    def __init__(self, app: Any, origins: AppOrigins) -> None:
        self.app, self.origins = app, origins

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if not self.origins.host_serves(host, scope["path"]):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 4404})
                    return
                problem = NotFound("Nothing here: this host serves one app.", code="not_found")
                await render_problem(problem, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
