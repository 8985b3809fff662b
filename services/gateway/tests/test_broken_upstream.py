"""An upstream that dies mid-body: the client must not mistake a truncated body for a whole one,
while an event stream may simply end (EventSource reconnects). Served by a raw TCP server so the
failure is exact."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest


@pytest.fixture
async def raw_upstream() -> AsyncIterator[str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        if b" /truncated " in request:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
            writer.write(b'{"partial":')
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            event = b"data: one\n\n"
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.transport.abort()  # gone without finishing the body

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def test_truncated_body_aborts_the_client_connection(stack, raw_upstream):
    gateway = await stack.gateway(upstreams={"metering": raw_upstream})
    async with httpx.AsyncClient(base_url=gateway) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get("/api/metering/truncated", headers=stack.bearer())
        after = await client.get("/healthz")
    assert after.status_code == 200


async def test_event_stream_cut_by_upstream_ends_cleanly(stack, raw_upstream):
    gateway = await stack.gateway(upstreams={"metering": raw_upstream})
    async with (
        httpx.AsyncClient(base_url=gateway) as client,
        client.stream("GET", "/api/metering/events", headers=stack.bearer()) as resp,
    ):
        lines = [line async for line in resp.aiter_lines()]
    assert "data: one" in lines


async def test_cors_preflight_reaches_upstream_without_token(gateway):
    async with httpx.AsyncClient(base_url=gateway) as client:
        preflight = await client.options(
            "/api/catalog/echo", headers={"Origin": "http://console.test", "Access-Control-Request-Method": "POST"}
        )
        plain_options = await client.options("/api/catalog/echo")
    assert preflight.status_code == 405  # the upstream's answer (no CORS configured there), not the gateway's 401
    assert plain_options.status_code == 401
