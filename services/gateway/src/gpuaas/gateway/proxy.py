"""HTTP reverse proxy: `/api/<segment>/<path>` -> `<upstream>/<path>`, bodies streamed both ways.

Request bodies go upstream as they arrive (the kit's body limit still applies: 413 once exceeded);
responses are relayed chunk by chunk as read from the socket, so SSE events reach the client one
by one. Upstream failures become the gateway's own problem+json: 502 `upstream_unavailable`,
504 `upstream_timeout`, 503 `upstream_busy` (connection pool exhausted).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from urllib.parse import parse_qsl, urlencode

import anyio
import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from gpuaas.gateway.edge import (
    admit,
    downstream_response_headers,
    log_fields,
    render_problem,
    upstream_request_headers,
)
from gpuaas.gateway.runtime import Gateway, GatewayRuntime
from gpuaas.gateway.upstreams import Upstream, segments
from gpuaas.kit.errors import NotFound, Problem
from gpuaas.kit.logging import get_logger

log = get_logger(__name__)
router = APIRouter()

METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
STREAM_LEAVES = frozenset({"stream", "events"})


class UpstreamUnavailable(Problem):
    status, code, title = 502, "upstream_unavailable", "Upstream unavailable"


class UpstreamTimeout(Problem):
    status, code, title = 504, "upstream_timeout", "Upstream timed out"


class UpstreamBusy(Problem):
    status, code, title = 503, "upstream_busy", "Gateway busy"


class UpstreamStreamBroken(Exception):
    """The upstream failed mid-body: the client connection is aborted so the body isn't taken as complete."""


class RelayResponse(StreamingResponse):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except UpstreamStreamBroken:
            # Return without finishing the body: the server closes the connection, so the client sees
            # a truncated response rather than a complete-looking one (already logged by _relay).
            return


def unknown_service(segment: str) -> NotFound:
    return NotFound(f"No service is routed at /api/{segment}/.", code="unknown_service")


def upstream_url(base_url: str, scope: Scope, *, strip_query_token: bool) -> str:
    """The upstream URL: the raw (still percent-encoded) path after /api/<segment>, and the query."""
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
    parts = raw_path.split(b"/", 3)  # b"", b"api", segment, rest
    rest = b"/" + (parts[3] if len(parts) > 3 else b"")
    query: str = scope.get("query_string", b"").decode("latin-1")
    if strip_query_token and query:
        query = urlencode([(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k != "access_token"])
    return base_url + rest.decode("latin-1") + (f"?{query}" if query else "")


def _timeout(rt: GatewayRuntime, request: Request, rest: str) -> dict[str, float | None]:
    s = rt.settings
    parts = segments(rest)
    streaming = "text/event-stream" in request.headers.get("accept", "") or bool(parts and parts[-1] in STREAM_LEAVES)
    read = s.stream_idle_timeout_s if streaming else s.upstream_timeout_s
    return httpx.Timeout(
        s.upstream_timeout_s, connect=s.upstream_connect_timeout_s, read=read, pool=s.upstream_connect_timeout_s
    ).as_dict()


def _has_body(request: Request) -> bool:
    length = request.headers.get("content-length")
    return (length is not None and length != "0") or "transfer-encoding" in request.headers


async def _request_body(request: Request) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        if chunk:
            yield chunk


@router.api_route("/api/{service}/{path:path}", methods=METHODS, include_in_schema=False)
async def proxy_http(request: Request, rt: Gateway, service: str, path: str) -> Response:
    instance = request.url.path
    upstream = rt.upstreams.get(service)
    if upstream is None:
        return render_problem(unknown_service(service), instance)
    rest = "/" + path
    peer = request.client.host if request.client else None
    try:
        admission = await admit(rt, upstream, rest, request.headers, request.query_params, peer, request.method)
    except Problem as exc:
        return render_problem(exc, instance)

    headers = upstream_request_headers(
        request.scope["headers"],
        peer=peer,
        scheme=request.url.scheme,
        trusted_peer=peer in rt.settings.trusted_proxies,
        query_token=admission.query_token,
    )
    try:
        outbound = httpx.Request(
            request.method,
            upstream_url(upstream.base_url, request.scope, strip_query_token=admission.query_token is not None),
            headers=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],  # byte-exact
            content=_request_body(request) if _has_body(request) else None,
            extensions={"timeout": _timeout(rt, request, rest)},
        )
    except httpx.InvalidURL as exc:
        return render_problem(Problem(f"The request URL cannot be forwarded: {exc}", code="invalid_path"), instance)

    started = time.perf_counter()
    try:
        resp = await rt.client.send(outbound, stream=True)
    except ClientDisconnect:
        return Response(status_code=499)  # nobody is listening any more
    except httpx.PoolTimeout:
        return _failed(rt, upstream, "busy", UpstreamBusy("Too many concurrent upstream requests."), instance)
    except httpx.TimeoutException:
        detail = f"{upstream.segment} did not answer in time."
        return _failed(rt, upstream, "timeout", UpstreamTimeout(detail), instance)
    except httpx.TransportError as exc:
        log.warning("upstream_unavailable", service=upstream.name, error=repr(exc))
        detail = f"{upstream.segment} is unavailable."
        return _failed(rt, upstream, "unavailable", UpstreamUnavailable(detail), instance)

    rt.metrics.upstream_requests.labels(upstream.name, str(resp.status_code)).inc()
    log.info(
        "proxied",
        method=request.method,
        path=instance,
        status=resp.status_code,
        duration_ms=round((time.perf_counter() - started) * 1000, 1),
        **log_fields(upstream, admission),
    )
    event_stream = resp.headers.get("content-type", "").startswith("text/event-stream")
    response = RelayResponse(
        _relay(resp, upstream, event_stream), status_code=resp.status_code, background=BackgroundTask(resp.aclose)
    )
    response.raw_headers = downstream_response_headers(resp.headers.raw)
    if event_stream:
        response.raw_headers.append((b"x-accel-buffering", b"no"))  # tell any proxy in front not to buffer
    return response


def _failed(rt: GatewayRuntime, upstream: Upstream, status: str, exc: Problem, instance: str) -> Response:
    rt.metrics.upstream_requests.labels(upstream.name, status).inc()
    return render_problem(exc, instance)


async def _relay(resp: httpx.Response, upstream: Upstream, event_stream: bool) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    except httpx.TransportError as exc:
        log.warning("upstream_stream_broken", service=upstream.name, error=repr(exc), event_stream=event_stream)
        if not event_stream:  # an event stream may just end: the client reconnects
            raise UpstreamStreamBroken(upstream.name) from exc
    finally:
        with anyio.CancelScope(shield=True):
            await resp.aclose()
