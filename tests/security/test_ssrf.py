"""Issue 17, defect 3: no server-side request forgery through tenants' identity providers.

A tenant admin controls an IdP's issuer and, through it, the discovery document (token endpoint,
JWKS URI, authorization endpoint); an unauthenticated `GET /auth/sso/start` makes identity fetch the
issuer. Here identity runs with the production outbound defaults (loopback, private, link-local ...
denied) except 127.0.0.2, the stand-in for a public IdP address, and with the test's own DNS server
as the operator's resolver. An internal HTTP server on 127.0.0.1 serves a perfectly good discovery
document: were it ever reached, the login would start; it must never see a connection.

Every refusal and failure, whatever answered (nothing, a non-HTTP service, an HTTP error, a redirect,
an oversized body, a document pointing elsewhere), is one and the same problem body.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from .federation_support import IDP_HOST, IdentityUnderTest, LoopbackDns, Servers, closed_port, identity_app

GENERIC = {
    "type": "https://gpuaas.dev/problems/idp_unreachable",
    "title": "Identity provider unreachable",
    "status": 502,
    "detail": "the identity provider could not be used; ask your organisation's administrator",
    "code": "idp_unreachable",
}


def discovery(issuer: str, **override: str) -> bytes:
    return json.dumps(
        {
            "issuer": issuer,
            "authorization_endpoint": f"{issuer}/authorize",
            "token_endpoint": f"{issuer}/token",
            "jwks_uri": f"{issuer}/jwks",
            **override,
        }
    ).encode()


@dataclass
class World:
    identity: IdentityUnderTest
    dns: LoopbackDns
    servers: Servers
    internal: int  # the internal HTTP service's port on 127.0.0.1
    tenant: dict[str, Any]


@pytest.fixture(scope="module")
async def world(infra) -> AsyncIterator[World]:
    dns = LoopbackDns().start()
    servers = Servers()
    internal_box: list[int] = []

    def internal_service(head: bytes) -> tuple[int, dict[str, str], bytes]:
        # Answers like an OpenID provider would, for whichever issuer the request names.
        host = head.split(b"\r\nhost: ", 1)[-1].split(b"\r\n", 1)[0].decode() if b"host: " in head else ""
        return 200, {"content-type": "application/json"}, discovery(f"https://{host}")

    internal_box.append(await servers.http("127.0.0.1", internal_service))
    for name in ("internal.ssrf.test", "localhost.ssrf.test"):
        dns.set(name, "A", "127.0.0.1")
    dns.set("mixed.ssrf.test", "A", "93.184.216.34", "127.0.0.1")
    dns.set("v6.ssrf.test", "AAAA", "::1")
    dns.set("mapped.ssrf.test", "AAAA", "::ffff:127.0.0.1")
    dns.set("metadata.ssrf.test", "A", "169.254.169.254")
    dns.set("private.ssrf.test", "A", "10.0.0.1")
    try:
        async with identity_app(infra.admin_url, infra.kafka_bootstrap, dns_nameservers=[dns.nameserver]) as identity:
            yield World(identity, dns, servers, internal_box[0], await identity.tenant())
    finally:
        await servers.close()
        dns.stop()


async def register(w: World, issuer: str) -> Any:
    return await w.identity.client.post(
        f"/tenants/{w.tenant['tenant_id']}/identity-providers",
        json={"name": "idp", "issuer": issuer, "client_id": "c", "domains": [f"{w.tenant['slug']}.example"]},
        headers=w.tenant["admin"],
    )


async def start(w: World, issuer: str) -> Any:
    r = await register(w, issuer)
    assert r.status_code == 201, r.text
    return await w.identity.client.get("/auth/sso/start", params={"idp_id": r.json()["idp_id"]})


def generic(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("correlation_id", "instance")}


@pytest.mark.parametrize(
    "issuer",
    [
        "http://idp.example.com",  # plain http to a host the operator did not list
        "http://127.0.0.1:5432",
        "https://127.0.0.1:5432",  # literal loopback
        "https://127.1.2.3",
        "https://10.0.0.1",
        "https://172.16.0.1",
        "https://192.168.1.1",
        "https://100.64.0.1",  # shared address space (CGNAT)
        "https://169.254.169.254/latest/meta-data",  # cloud metadata
        "https://0.0.0.0",
        "https://224.0.0.1",
        "https://[::1]:8080",
        "https://[fe80::1]",
        "https://[fc00::1]",
        "https://[::ffff:127.0.0.1]",
        "https://[64:ff9b::a00:1]",  # NAT64 form of 10.0.0.1
        "https://idp.example.com/?x=",  # a query: a chosen path behind the well-known suffix
        "https://idp.example.com/admin?",
        "https://idp.example.com/#frag",
        "https://user:pw@idp.example.com",
        "ftp://idp.example.com",  # refused by the schema already (validation_error)
    ],
)
async def test_registration_refuses_internal_and_odd_issuers(world: World, issuer: str) -> None:
    r = await register(world, issuer)
    assert r.status_code == 422 and r.json()["code"] in ("issuer_not_allowed", "validation_error"), (issuer, r.text)
    assert r.json()["code"] == "issuer_not_allowed" or issuer.startswith("ftp:")


async def test_registration_accepts_a_public_https_issuer(world: World) -> None:
    r = await register(world, "https://login.example.com/realms/acme/")
    assert r.status_code == 201, r.text
    assert r.json()["issuer"] == "https://login.example.com/realms/acme"


async def test_every_internal_target_and_failure_answers_the_same(world: World) -> None:
    w, servers = world, world.servers

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(10)

    internal = f"http://127.0.0.1:{w.internal}"
    big = json.dumps({"issuer": "x", "pad": "a" * 100_000}).encode()
    ports = {
        "not_found": await servers.http(IDP_HOST, lambda h: (404, {}, b"<h1>Not Found</h1>")),
        "html": await servers.http(IDP_HOST, lambda h: (200, {"content-type": "text/html"}, b"<html></html>")),
        "redirect": await servers.http(
            IDP_HOST, lambda h: (302, {"location": f"{internal}/.well-known/openid-configuration"}, b"")
        ),
        "oversized": await servers.http(IDP_HOST, lambda h: (200, {"content-type": "application/json"}, big)),
        "garbage": await servers.start(IDP_HOST, garbage),
        "silent": await servers.start(IDP_HOST, silent),
    }
    elsewhere_port = closed_port(IDP_HOST)
    box: list[int] = []
    ports["auth_elsewhere"] = await servers.http(
        IDP_HOST,
        lambda h: (200, {}, discovery(f"http://{IDP_HOST}:{box[0]}", authorization_endpoint=f"{internal}/authorize")),
    )
    box.append(ports["auth_elsewhere"])
    ports["other_issuer"] = await servers.http(IDP_HOST, lambda h: (200, {}, discovery("https://someone.else")))
    port = w.internal
    issuers = [
        f"https://internal.ssrf.test:{port}",  # a DNS name for loopback, a live HTTP service behind it
        f"https://internal.ssrf.test:{closed_port()}",
        f"https://localhost.ssrf.test:{port}",
        f"https://mixed.ssrf.test:{port}",  # one public and one loopback answer: refused as a whole
        f"https://v6.ssrf.test:{port}",
        f"https://mapped.ssrf.test:{port}",
        "https://metadata.ssrf.test",
        "https://private.ssrf.test",
        "https://nxdomain.ssrf.test",
        f"http://{IDP_HOST}:{elsewhere_port}",  # allowed address, closed port
        *(f"http://{IDP_HOST}:{p}" for p in ports.values()),
    ]
    bodies = {}
    for issuer in issuers:
        r = await start(w, issuer)
        assert r.status_code == 502, (issuer, r.status_code, r.text)
        bodies[issuer] = generic(r.json())
    assert all(b == GENERIC for b in bodies.values()), bodies
    assert w.servers.hits.get(w.internal, 0) == 0  # nothing ever connected to the internal service
    # The servers on the allowed address were reached (the answers are the same, not short-circuited).
    assert all(w.servers.hits.get(p, 0) >= 1 for k, p in ports.items()), (ports, w.servers.hits)


async def test_a_good_idp_is_reached_and_redirects_only_to_its_own_endpoint(world: World) -> None:
    w = world
    box: list[int] = []
    port = await w.servers.http(IDP_HOST, lambda h: (200, {}, discovery(f"http://{IDP_HOST}:{box[0]}")))
    box.append(port)
    r = await start(w, f"http://{IDP_HOST}:{port}")
    assert r.status_code == 302, r.text
    location = urlsplit(r.headers["location"])
    assert (location.scheme, location.netloc, location.path) == ("http", f"{IDP_HOST}:{port}", "/authorize")
    assert w.servers.requests[port][0].startswith(b"GET /.well-known/openid-configuration HTTP/1.1")


async def test_token_and_jwks_endpoints_are_guarded_too(world: World) -> None:
    """The discovery document names the token endpoint and the JWKS: pointed inside, the callback (an
    unauthenticated request with the state from /auth/sso/start) answers the same generic problem."""
    w = world
    internal = f"http://127.0.0.1:{w.internal}"
    results = []
    for override in ({"token_endpoint": f"{internal}/token"}, {"jwks_uri": f"{internal}/jwks"}):
        box: list[int] = []

        def idp(
            head: bytes, override: dict[str, str] = override, box: list[int] = box
        ) -> tuple[int, dict[str, str], bytes]:
            if head.startswith(b"POST /token"):
                return 200, {}, json.dumps({"id_token": "e30.e30.sig", "token_type": "Bearer"}).encode()
            return 200, {}, discovery(f"http://{IDP_HOST}:{box[0]}", **override)

        box.append(await w.servers.http(IDP_HOST, idp))
        r = await start(w, f"http://{IDP_HOST}:{box[0]}")
        assert r.status_code == 302, r.text
        state = parse_qs(urlsplit(r.headers["location"]).query)["state"][0]
        cb = await w.identity.client.get("/auth/sso/callback", params={"state": state, "code": "abc"})
        assert cb.status_code == 502, cb.text
        results.append(generic(cb.json()))
    assert results == [GENERIC, GENERIC]
    assert w.servers.hits.get(w.internal, 0) == 0
