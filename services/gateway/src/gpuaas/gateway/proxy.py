"""HTTP reverse proxy: `/api/<segment>/<path>` -> `<upstream>/<path>`, bodies streamed both ways.

Request bodies go upstream as they arrive (the kit's body limit still applies: 413 once exceeded);
responses are relayed chunk by chunk as read from the socket, so SSE events reach the client one
by one. A small response with a Content-Length (<= 64 KiB, not an event stream: most API answers) is
read whole and sent in one piece, which spares a streaming task per request; a failure mid-body still
truncates and aborts the client connection as the streamed path does. Upstream failures become the
gateway's own problem+json: 502 `upstream_unavailable`, 504 `upstream_timeout`, 503 `upstream_busy`
(connection pool exhausted).

Hot path (bench/gateway.py measures it): a plain Starlette route (no FastAPI dependency solving), the
shared transport called directly (the client's cookie/auth/redirect layers do nothing for a proxy: its
cookie jar never stores and redirects are not followed), and verified tokens cached (tokens.py).
"""

from __future__ import annotations

import functools
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
from gpuaas.gateway.runtime import GatewayRuntime, runtime
from gpuaas.gateway.upstreams import Upstream, segments
from gpuaas.kit.errors import NotFound, Problem
from gpuaas.kit.logging import get_logger

log = get_logger(__name__)
router = APIRouter()

METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
STREAM_LEAVES = frozenset({"stream", "events"})
BUFFER_MAX_BYTES = 64 * 1024  # responses up to this size (with a Content-Length) are read whole, sent at once


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
    return _timeouts(s.upstream_timeout_s, s.upstream_connect_timeout_s, s.stream_idle_timeout_s, streaming)


@functools.lru_cache(maxsize=16)
def _timeouts(total: float, connect: float, stream_idle: float, streaming: bool) -> dict[str, float | None]:
    read = stream_idle if streaming else total
    return httpx.Timeout(total, connect=connect, read=read, pool=connect).as_dict()


def _has_body(request: Request) -> bool:
    length = request.headers.get("content-length")
    return (length is not None and length != "0") or "transfer-encoding" in request.headers


async def _request_body(request: Request) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        if chunk:
            yield chunk


async def proxy_http(request: Request) -> Response:
    rt = runtime(request)
    service: str = request.path_params["service"]
    path: str = request.path_params["path"]
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
        trusted=rt.settings.trusted_proxies,
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
        resp = await rt.transport.handle_async_request(outbound)
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
    resp.request = outbound
    event_stream = resp.headers.get("content-type", "").startswith("text/event-stream")
    length = resp.headers.get("content-length")
    if not event_stream and length is not None and length.isdigit() and int(length) <= BUFFER_MAX_BYTES:
        return await _buffered(resp, upstream)
    response = RelayResponse(
        _relay(resp, upstream, event_stream), status_code=resp.status_code, background=BackgroundTask(resp.aclose)
    )
    response.raw_headers = downstream_response_headers(resp.headers.raw)
    if event_stream:
        response.raw_headers.append((b"x-accel-buffering", b"no"))  # tell any proxy in front not to buffer
    return response


async def _buffered(resp: httpx.Response, upstream: Upstream) -> Response:
    """The whole (small) body, then one response; mid-body failure: what arrived, then an aborted connection."""
    chunks: list[bytes] = []
    try:
        async for chunk in resp.aiter_raw():
            chunks.append(chunk)
    except httpx.TransportError as exc:
        log.warning("upstream_stream_broken", service=upstream.name, error=repr(exc), event_stream=False)
        response: Response = RelayResponse(_truncated(chunks, upstream), status_code=resp.status_code)
    else:
        response = Response(b"".join(chunks), status_code=resp.status_code)
    finally:
        with anyio.CancelScope(shield=True):
            await resp.aclose()
    response.raw_headers = downstream_response_headers(resp.headers.raw)
    return response


async def _truncated(chunks: list[bytes], upstream: Upstream) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk
    raise UpstreamStreamBroken(upstream.name)


router.add_route("/api/{service}/{path:path}", proxy_http, methods=METHODS, include_in_schema=False)


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
