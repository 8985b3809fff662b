"""WebSocket passthrough: `/api/<segment>/<path>` upgrades are bridged to the upstream's ws:// URL.

The upstream is dialled first, so its refusal (status and body) reaches the client as the
handshake response and its chosen subprotocol is the one accepted. Then text and binary messages
flow both ways until one side closes; its close code and reason are passed on to the other
(reserved codes that cannot be sent are mapped: no status -> 1000, connection lost -> 1014 towards
the client / 1001 towards the upstream).
"""

from __future__ import annotations

import asyncio
from contextlib import suppress

from fastapi import APIRouter, WebSocket
from fastapi.responses import Response
from starlette.websockets import WebSocketDisconnect
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.frames import EXTERNAL_CLOSE_CODES
from websockets.typing import Subprotocol

from gpuaas.gateway.edge import admit, log_fields, render_problem, upstream_request_headers
from gpuaas.gateway.proxy import UpstreamTimeout, UpstreamUnavailable, unknown_service, upstream_url
from gpuaas.gateway.runtime import Gateway
from gpuaas.kit.errors import Problem
from gpuaas.kit.logging import get_logger

log = get_logger(__name__)
router = APIRouter()

# Handshake headers belong to each hop; websockets writes its own towards the upstream.
HANDSHAKE = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
        "sec-websocket-accept",
        "content-length",
    }
)
BAD_GATEWAY = 1014
GOING_AWAY = 1001


def _sendable(code: int | None, *, lost: int) -> int:
    if code is None or code == 1006:
        return lost
    if code == 1005:  # closed without a status code
        return 1000
    return code if code in EXTERNAL_CLOSE_CODES or 3000 <= code < 5000 else lost


@router.websocket("/api/{service}/{path:path}")
async def proxy_websocket(websocket: WebSocket, rt: Gateway, service: str, path: str) -> None:
    instance = websocket.url.path
    upstream = rt.upstreams.get(service)
    if upstream is None:
        await _deny(websocket, render_problem(unknown_service(service), instance))
        return
    peer = websocket.client.host if websocket.client else None
    try:
        admission = await admit(rt, upstream, "/" + path, websocket.headers, websocket.query_params, peer)
    except Problem as exc:
        await _deny(websocket, render_problem(exc, instance))
        return

    headers = upstream_request_headers(
        websocket.scope["headers"],
        peer=peer,
        scheme=websocket.url.scheme,
        trusted=rt.settings.trusted_proxies,
        query_token=admission.query_token,
        drop=HANDSHAKE,
    )
    url = upstream_url(upstream.ws_base_url, websocket.scope, strip_query_token=admission.query_token is not None)
    subprotocols = [Subprotocol(p) for p in websocket.scope.get("subprotocols", [])]
    try:
        upstream_ws = await connect(
            url,
            additional_headers=headers,
            subprotocols=subprotocols or None,
            user_agent_header=None if "user-agent" in websocket.headers else "gpuaas-gateway",
            open_timeout=rt.settings.ws_open_timeout_s,
            max_size=rt.settings.ws_max_message_bytes,
            proxy=None,
        )
    except InvalidStatus as exc:  # the upstream refused the upgrade: pass its answer on
        refused = exc.response
        rt.metrics.upstream_requests.labels(upstream.name, str(refused.status_code)).inc()
        content_type = refused.headers.get("content-type", "text/plain")
        await _deny(websocket, Response(refused.body or b"", refused.status_code, media_type=content_type))
        return
    except TimeoutError:
        rt.metrics.upstream_requests.labels(upstream.name, "timeout").inc()
        await _deny(websocket, render_problem(UpstreamTimeout(f"{upstream.segment} did not answer in time."), instance))
        return
    except (OSError, InvalidHandshake, InvalidURI) as exc:
        log.warning("upstream_unavailable", service=upstream.name, error=repr(exc), websocket=True)
        rt.metrics.upstream_requests.labels(upstream.name, "unavailable").inc()
        await _deny(websocket, render_problem(UpstreamUnavailable(f"{upstream.segment} is unavailable."), instance))
        return

    rt.metrics.upstream_requests.labels(upstream.name, "101").inc()
    rt.metrics.open_websockets.labels(upstream.name).inc()
    fields = log_fields(upstream, admission)
    log.info("websocket_opened", path=instance, subprotocol=upstream_ws.subprotocol, **fields)
    try:
        await websocket.accept(subprotocol=upstream_ws.subprotocol)
        closed_by, code = await _bridge(websocket, upstream_ws)
        log.info("websocket_closed", path=instance, closed_by=closed_by, code=code, **fields)
    finally:
        rt.metrics.open_websockets.labels(upstream.name).dec()
        await upstream_ws.close(GOING_AWAY)  # no-op when already closed


async def _bridge(websocket: WebSocket, upstream_ws: ClientConnection) -> tuple[str, int | None]:
    """Pump both directions until one side closes; returns (who closed, their code)."""
    up = asyncio.create_task(_client_to_upstream(websocket, upstream_ws))
    down = asyncio.create_task(_upstream_to_client(upstream_ws, websocket))
    try:
        done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (up, down):
            task.cancel()
        await asyncio.gather(up, down, return_exceptions=True)
    closed_by, code = next(iter(done)).result()
    if closed_by == "upstream":
        rcvd = upstream_ws.protocol.close_rcvd
        code = _sendable(rcvd.code if rcvd else None, lost=BAD_GATEWAY)
        reason = rcvd.reason if rcvd else "upstream connection lost"
        with suppress(RuntimeError, OSError, WebSocketDisconnect):
            await websocket.close(code, reason)
    return closed_by, code


async def _client_to_upstream(websocket: WebSocket, upstream_ws: ClientConnection) -> tuple[str, int | None]:
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            code = message.get("code")
            await upstream_ws.close(_sendable(code, lost=GOING_AWAY), message.get("reason") or "")
            return "client", code
        try:
            if (text := message.get("text")) is not None:
                await upstream_ws.send(text)
            elif (data := message.get("bytes")) is not None:
                await upstream_ws.send(data)
        except ConnectionClosed:
            return "upstream", None


async def _upstream_to_client(upstream_ws: ClientConnection, websocket: WebSocket) -> tuple[str, int | None]:
    try:
        async for data in upstream_ws:
            try:
                if isinstance(data, str):
                    await websocket.send_text(data)
                else:
                    await websocket.send_bytes(data)
            except (RuntimeError, OSError, WebSocketDisconnect):  # the client is gone
                await upstream_ws.close(GOING_AWAY)
                return "client", None
    except ConnectionClosed:
        pass
    return "upstream", None


async def _deny(websocket: WebSocket, response: Response) -> None:
    """Refuse the upgrade with an HTTP response (ASGI denial extension), else a policy close."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(response)
    else:
        await websocket.close(code=1008)
