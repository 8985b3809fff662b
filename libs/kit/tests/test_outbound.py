"""The outbound-fetch guard (gpuaas.kit.outbound): address rules, URL rules, and fetches against real
servers on loopback (allowed explicitly, as an operator would allow a network)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gpuaas.kit.outbound import (
    OutboundError,
    OutboundPolicy,
    address_allowed,
    check_url,
    denied_by_default,
    fetch_json,
)

DENIED = [
    "127.0.0.1",
    "127.255.0.9",
    "10.1.2.3",
    "172.16.0.1",
    "192.168.0.1",
    "169.254.169.254",
    "100.64.0.1",
    "0.0.0.0",
    "224.0.0.1",
    "239.255.255.250",
    "255.255.255.255",
    "192.0.2.1",  # documentation
    "198.18.0.1",  # benchmarking
    "240.0.0.1",  # reserved
    "::1",
    "::",
    "fe80::1",
    "fc00::1",
    "fd12:3456::1",
    "ff02::1",
    "ff0e::1",
    "2001:db8::1",
    "::ffff:127.0.0.1",
    "::ffff:10.0.0.1",
    "2002:7f00:1::1",  # 6to4 around 127.0.0.1
    "2002:a00:1::1",  # 6to4 around 10.0.0.1
    "64:ff9b::7f00:1",  # NAT64 around 127.0.0.1
    "2001:0:4136:e378:8000:63bf:80ff:fffe",  # Teredo around 127.0.0.1 (obfuscated ~)
]
ALLOWED = ["8.8.8.8", "93.184.216.34", "1.1.1.1", "2606:4700:4700::1111", "2a00:1450:4001::1", "::ffff:8.8.8.8"]


@pytest.mark.parametrize("ip", DENIED)
def test_denied_by_default(ip: str) -> None:
    assert denied_by_default(ipaddress.ip_address(ip)), ip


@pytest.mark.parametrize("ip", ALLOWED)
def test_public_addresses_pass(ip: str) -> None:
    assert not denied_by_default(ipaddress.ip_address(ip)), ip


def test_operator_networks_allow_exactly_what_they_name() -> None:
    nets = OutboundPolicy(allowed_networks=("127.0.0.2/32", "fd00::/8")).networks()
    assert address_allowed(ipaddress.ip_address("127.0.0.2"), nets)
    assert address_allowed(ipaddress.ip_address("fd00::5"), nets)
    assert not address_allowed(ipaddress.ip_address("127.0.0.1"), nets)
    assert not address_allowed(ipaddress.ip_address("::1"), nets)


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("https://idp.example.com/x", True),
        ("http://idp.example.com/x", False),
        ("http://127.0.0.2:8080/x", True),  # listed below
        ("file:///etc/passwd", False),
        ("gopher://idp.example.com", False),
        ("https://user:pw@idp.example.com", False),
        ("https:///nohost", False),
    ],
)
def test_check_url(url: str, ok: bool) -> None:
    policy = OutboundPolicy(plain_http_hosts=("127.0.0.2",))
    if ok:
        check_url(url, policy)
    else:
        with pytest.raises(OutboundError):
            check_url(url, policy)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler, str], Awaitable[int]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler, host: str = "127.0.0.2") -> int:
        server = await asyncio.start_server(handler, host, 0)
        servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    yield start
    for s in servers:
        s.close()


def http(status: int, body: bytes, headers: dict[str, str] | None = None, length: bool = True) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        handler.heads.append(head)
        lines = [f"HTTP/1.1 {status} X", "connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        if length:
            lines.append(f"content-length: {len(body)}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        for i in range(0, len(body), 4096):  # no content-length: the body streams until close
            writer.write(body[i : i + 4096])
            await writer.drain()
        writer.close()

    handler.heads = []
    return handler


POLICY = OutboundPolicy(
    allowed_networks=("127.0.0.2/32",), plain_http_hosts=("127.0.0.2", "pinned.test"), max_body_bytes=1000
)


async def test_fetch_json_from_an_allowed_server(serve) -> None:
    port = await serve(http(200, b'{"ok": true}'))
    assert await fetch_json(POLICY, "GET", f"http://127.0.0.2:{port}/x") == (200, {"ok": True})


async def test_loopback_is_refused_without_connecting(serve) -> None:
    handler = http(200, b"{}")
    port = await serve(handler, "127.0.0.1")
    policy = OutboundPolicy(plain_http_hosts=("127.0.0.1", "localhost"))
    for url in (f"http://127.0.0.1:{port}/", f"http://localhost:{port}/"):  # the system resolver for localhost
        with pytest.raises(OutboundError) as exc:
            await fetch_json(policy, "GET", url)
        assert exc.value.reason == "address_denied"
    assert handler.heads == []


@pytest.mark.parametrize("length", [True, False])
async def test_oversized_bodies_are_cut_off(serve, length: bool) -> None:
    port = await serve(http(200, json.dumps({"pad": "a" * 50_000}).encode(), length=length))
    with pytest.raises(OutboundError) as exc:
        await fetch_json(POLICY, "GET", f"http://127.0.0.2:{port}/")
    assert exc.value.reason == "too_large"


async def test_redirects_are_not_followed(serve) -> None:
    target = http(200, b"{}")
    target_port = await serve(target)
    port = await serve(http(302, b"", {"location": f"http://127.0.0.2:{target_port}/"}))
    with pytest.raises(OutboundError) as exc:
        await fetch_json(POLICY, "GET", f"http://127.0.0.2:{port}/")
    assert exc.value.reason == "redirect" and target.heads == []


async def test_non_json_and_non_http_fail_alike(serve) -> None:
    async def ssh(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n")
        await writer.drain()
        writer.close()

    for handler in (http(200, b"<html>"), ssh):
        port = await serve(handler)
        with pytest.raises(OutboundError):
            await fetch_json(POLICY, "GET", f"http://127.0.0.2:{port}/")


async def test_deadline_bounds_a_dripping_server(serve) -> None:
    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
        for _ in range(100):
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.1)

    port = await serve(drip)
    policy = OutboundPolicy(allowed_networks=("127.0.0.2/32",), plain_http_hosts=("127.0.0.2",), deadline_s=1.0)
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(OutboundError) as exc:
        await fetch_json(policy, "GET", f"http://127.0.0.2:{port}/")
    assert exc.value.reason == "timeout" and asyncio.get_running_loop().time() - t0 < 3


async def test_the_checked_address_is_the_one_connected_and_the_host_name_is_kept(serve) -> None:
    """DNS is asked once; a second, different answer (rebinding) is never used; Host stays the name."""
    handler = http(200, b"{}")
    port = await serve(handler)
    answers = [["127.0.0.2"], ["127.0.0.1"]]
    asked: list[str] = []

    async def rebinding(host: str) -> list[str]:
        asked.append(host)
        return answers[min(len(asked) - 1, 1)]

    policy = OutboundPolicy(allowed_networks=("127.0.0.2/32",), plain_http_hosts=("pinned.test",), resolver=rebinding)
    assert await fetch_json(policy, "GET", f"http://pinned.test:{port}/x") == (200, {})
    assert asked == ["pinned.test"]
    assert f"host: pinned.test:{port}".encode() in handler.heads[0].lower()
    # Asked again, the name now rebinds to loopback: refused before any connection.
    with pytest.raises(OutboundError) as exc:
        await fetch_json(policy, "GET", f"http://pinned.test:{port}/x")
    assert exc.value.reason == "address_denied" and len(handler.heads) == 1
