"""SSE relayed event by event, and WebSocket sessions bridged to a real upstream."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus


async def test_sse_events_arrive_one_by_one(stack, gateway):
    received: list[tuple[float, str, bool]] = []
    started = time.monotonic()
    async with (
        httpx.AsyncClient(base_url=gateway) as client,
        client.stream(
            "GET",
            "/api/catalog/events/stream",
            params={"n": "3", "gap": "0.5"},
            headers={**stack.bearer(), "Accept": "text/event-stream"},
        ) as resp,
    ):
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for line in resp.aiter_lines():
            if line.startswith("data: tick"):
                received.append((time.monotonic() - started, line, stack.catalog.state.sse_finished))
    assert [line for _, line, _ in received] == ["data: tick 0", "data: tick 1", "data: tick 2"]
    first_at, _, finished_when_first = received[0]
    last_at = received[-1][0]
    assert not finished_when_first  # the first event was delivered while the upstream was still streaming
    assert last_at - first_at >= 0.8  # ... and not all at once at the end
    assert first_at < 1.2


async def test_sse_client_disconnect_releases_the_upstream(stack, gateway, eventually):
    # Long enough (10 000 events, 0.05 s apart: over 8 minutes) that only a cancellation can end it in time.
    async with httpx.AsyncClient(base_url=gateway) as client:
        async with client.stream(
            "GET", "/api/catalog/events/stream", params={"n": "10000", "gap": "0.05"}, headers=stack.bearer()
        ) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: tick"):
                    break
        assert not stack.catalog.state.sse_closed  # streaming while the client was reading
        # The client has gone: the gateway closes its upstream stream, and the upstream stops generating.
        await eventually(lambda: stack.catalog.state.sse_closed, timeout=5.0)
        assert not stack.catalog.state.sse_finished  # stopped, not run to the end
        # The gateway still serves after the abandoned stream.
        again = await client.get("/api/catalog/echo", headers=stack.bearer())
    assert again.status_code == 200


def ws_url(gateway: str, path: str) -> str:
    return "ws" + gateway.removeprefix("http") + path


async def test_websocket_text_and_binary_both_ways(stack, gateway):
    headers = {**stack.bearer(), "X-Correlation-ID": "ws-corr-1"}
    async with connect(
        ws_url(gateway, "/api/catalog/ws/echo?x=1"), additional_headers=headers, subprotocols=["gpuaas.v1", "other"]
    ) as ws:
        assert ws.subprotocol == "gpuaas.v1"  # negotiated with the upstream
        hello = json.loads(await ws.recv())
        assert hello["authorization"] == headers["Authorization"]
        assert hello["correlation_id"] == "ws-corr-1"
        assert hello["forwarded_for"] == "127.0.0.1"
        assert hello["query"] == "x=1"
        assert hello["subprotocol"] == "gpuaas.v1"
        await ws.send("ping")
        assert await ws.recv() == "echo:ping"
        await ws.send(b"\x00\x01\x02")
        assert await ws.recv() == b"\x02\x01\x00"
        await ws.send("x" * 200_000)  # bigger than one frame read
        assert await ws.recv() == "echo:" + "x" * 200_000


async def test_websocket_upstream_close_code_reaches_client(stack, gateway):
    async with connect(ws_url(gateway, "/api/catalog/ws/echo"), additional_headers=stack.bearer()) as ws:
        await ws.recv()
        await ws.send("close:4001:bye now")
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert (ws.close_code, ws.close_reason) == (4001, "bye now")


async def test_websocket_upstream_lost_is_reported_as_bad_gateway(stack, gateway):
    async with connect(ws_url(gateway, "/api/catalog/ws/echo"), additional_headers=stack.bearer()) as ws:
        await ws.recv()
        await ws.send("crash")
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert ws.close_code == 1014
    assert ws.close_reason == "upstream connection lost"


async def test_websocket_client_close_code_reaches_upstream(stack, gateway, eventually):
    async with connect(ws_url(gateway, "/api/catalog/ws/echo"), additional_headers=stack.bearer()) as ws:
        await ws.recv()
        await ws.close(4002, "client done")
    await eventually(lambda: stack.catalog.state.ws_closes != [])
    assert stack.catalog.state.ws_closes == [(4002, "client done")]


async def test_websocket_needs_a_token_and_accepts_it_in_the_query_on_terminal(stack, gateway):
    with pytest.raises(InvalidStatus) as refused:
        async with connect(ws_url(gateway, "/api/catalog/ws/terminal")):
            pass
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body)["code"] == "missing_token"

    token = stack.issuer.token()
    async with connect(ws_url(gateway, f"/api/catalog/ws/terminal?access_token={token}&cols=80")) as ws:
        hello = json.loads(await ws.recv())
    assert hello["authorization"] == f"Bearer {token}"
    assert hello["query"] == "cols=80"

    with pytest.raises(InvalidStatus) as not_terminal:
        async with connect(ws_url(gateway, f"/api/catalog/ws/echo?access_token={token}")):
            pass
    assert not_terminal.value.response.status_code == 401


async def test_websocket_upstream_refusal_and_outage_are_reported(stack, gateway):
    with pytest.raises(InvalidStatus) as refused:  # no such WebSocket route upstream
        async with connect(ws_url(gateway, "/api/catalog/nope"), additional_headers=stack.bearer()):
            pass
    assert refused.value.response.status_code == 403
    with pytest.raises(InvalidStatus) as down:
        async with connect(ws_url(gateway, "/api/billing/ws/echo"), additional_headers=stack.bearer()):
            pass
    assert down.value.response.status_code == 502
    assert json.loads(down.value.response.body)["code"] == "upstream_unavailable"
    with pytest.raises(InvalidStatus) as unknown:
        async with connect(ws_url(gateway, "/api/nope/ws"), additional_headers=stack.bearer()):
            pass
    assert unknown.value.response.status_code == 404
