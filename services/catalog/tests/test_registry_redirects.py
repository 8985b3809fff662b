"""The registry client follows a registry's redirects only through the outbound guard (issue 28).

Registries commonly redirect blob downloads to storage elsewhere, so redirects are followed; but a
redirect to another host is a URL the registry chose, not the operator: it must pass the guard identity's
outbound calls use (gpuaas.kit.outbound: no loopback, private, link-local... address unless the operator
allows it in `registry_allowed_networks`; https unless the host is a plain-http one). The registry named
in the reference itself is the operator's choice and is reached as configured.

Before: `follow_redirects=True` without a guard, so a registry could make the catalog fetch from any
address (cloud metadata, the platform's own services). Loopback-only: a fake registry on 127.0.0.1
redirecting to a blob server on 127.0.0.2 (denied by default, as every loopback address is).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from gpuaas.catalog.oci import (
    OCI_CONFIG,
    OCI_LAYER_GZIP,
    OCI_MANIFEST,
    RegistryClient,
    TrustError,
    digest_of,
    parse_ref,
)

CONFIG = b'{"architecture":"amd64","os":"linux"}'
LAYER = b"layer bytes that the registry's storage serves"
MANIFEST = json.dumps(
    {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": digest_of(CONFIG), "size": len(CONFIG)},
        "layers": [{"mediaType": OCI_LAYER_GZIP, "digest": digest_of(LAYER), "size": len(LAYER)}],
    }
).encode()


@dataclass
class Server:
    port: int
    paths: list[str] = field(default_factory=list)


Route = Callable[[str], tuple[int, dict[str, str], bytes]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[str, Route], asyncio.Future[Server]]]:
    servers: list[asyncio.Server] = []

    async def start(host: str, route: Route) -> Server:
        seen = Server(0)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            path = head.split(" ", 2)[1]
            seen.paths.append(path)
            status, headers, body = route(path)
            lines = [f"HTTP/1.1 {status} X", "connection: close", f"content-length: {len(body)}"]
            lines += [f"{k}: {v}" for k, v in headers.items()]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, host, 0)
        servers.append(server)
        seen.port = int(server.sockets[0].getsockname()[1])
        return seen

    yield start
    for s in servers:
        s.close()


def storage(path: str) -> tuple[int, dict[str, str], bytes]:
    return (200, {}, LAYER) if path == "/blob" else (404, {}, b"")


def registry_redirecting_to(location: str) -> Route:
    def route(path: str) -> tuple[int, dict[str, str], bytes]:
        if path.endswith(f"/manifests/{digest_of(MANIFEST)}"):
            return 200, {"content-type": OCI_MANIFEST}, MANIFEST
        if path.endswith(f"/blobs/{digest_of(CONFIG)}"):
            return 200, {}, CONFIG
        if path.endswith(f"/blobs/{digest_of(LAYER)}"):
            return 307, {"location": location}, b""
        if path == "/blob":  # the registry's own storage path (a same-host redirect)
            return 200, {}, LAYER
        return 404, {}, b""

    return route


async def test_a_redirect_to_a_denied_address_is_refused(serve) -> None:
    store = await serve("127.0.0.2", storage)
    reg = await serve("127.0.0.1", registry_redirecting_to(f"http://127.0.0.2:{store.port}/blob"))
    ref = parse_ref(f"127.0.0.1:{reg.port}/app@{digest_of(MANIFEST)}")
    client = RegistryClient(["127.0.0.1", "127.0.0.2"], timeout_s=10)
    with pytest.raises(TrustError) as refused:
        await client.verify(ref)
    assert refused.value.code == "registry_redirect_refused" and refused.value.status == 502
    assert store.paths == []  # never reached: refused before connecting


async def test_a_redirect_the_operator_allows_is_followed(serve) -> None:
    store = await serve("127.0.0.2", storage)
    reg = await serve("127.0.0.1", registry_redirecting_to(f"http://127.0.0.2:{store.port}/blob"))
    ref = parse_ref(f"127.0.0.1:{reg.port}/app@{digest_of(MANIFEST)}")
    client = RegistryClient(["127.0.0.1", "127.0.0.2"], timeout_s=10, allowed_networks=["127.0.0.2/32"])
    verified = await client.verify(ref)
    assert verified.blobs_verified == 2 and store.paths == ["/blob"]
    # Allowed, but not a plain-http host: the redirect must stay on https.
    https_only = RegistryClient(["127.0.0.1"], timeout_s=10, allowed_networks=["127.0.0.2/32"])
    with pytest.raises(TrustError) as refused:
        await https_only.verify(ref)
    assert refused.value.code == "registry_redirect_refused" and store.paths == ["/blob"]


async def test_a_redirect_within_the_registry_is_followed(serve) -> None:
    route_holder: dict[str, Route] = {}
    reg = await serve("127.0.0.1", lambda path: route_holder["route"](path))
    route_holder["route"] = registry_redirecting_to(f"http://127.0.0.1:{reg.port}/blob")
    ref = parse_ref(f"127.0.0.1:{reg.port}/app@{digest_of(MANIFEST)}")
    verified = await RegistryClient(["127.0.0.1"], timeout_s=10).verify(ref)
    assert verified.blobs_verified == 2 and "/blob" in reg.paths
