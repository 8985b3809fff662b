"""ASGI middlewares every service shares (pure ASGI, so SSE/WebSocket responses stream untouched):

- correlation id: taken from `X-Correlation-ID` (or created), bound for logs and outbox events,
  echoed on the response;
- request metrics: latency histogram by route template;
- body limit: requests over `max_request_bytes` get 413 problem+json before the app reads them.
"""

from __future__ import annotations

import re
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpuaas.kit import context
from gpuaas.kit.errors import problem_response
from gpuaas.kit.metrics import ServiceMetrics

_CID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k == name:
            return v.decode("latin-1")
    return None


class CorrelationMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = header(scope, b"x-correlation-id")
        cid = given if given and _CID.match(given) else context.new_correlation_id()
        status = {"code": 500}
        started = time.perf_counter()

        async def send_with_cid(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-correlation-id", cid.encode())]
            await send(message)

        with context.bound(correlation=cid):
            try:
                await self.app(scope, receive, send_with_cid)
            finally:
                if scope["type"] == "http":
                    route = scope.get("route")
                    path = getattr(route, "path", None) or "unmatched"
                    self.metrics.http_latency.labels(scope["method"], path, str(status["code"])).observe(
                        time.perf_counter() - started
                    )


class BodyLimitMiddleware:
    """413 for bodies over the limit. A declared Content-Length is checked before reading; a chunked
    body is buffered up to the limit here (the app would otherwise see a read error and answer 400)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = header(scope, b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                await _too_large(self.max_bytes)(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # client went away
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                await _too_large(self.max_bytes)(scope, receive, send)
                return
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def _too_large(limit: int) -> Any:
    return problem_response(413, "payload_too_large", "Payload too large", f"The request body exceeds {limit} bytes.")
