"""What the SSRF and federation-hardening tests share: a real DNS server on loopback (dnspython over
UDP, answering from a zone the test edits), small real TCP/HTTP servers on loopback addresses, and an
in-process identity app whose outbound guard has the production defaults (loopback denied) except
for 127.0.0.2, the test's "public" IdP address.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import httpx

from gpuaas.identity.app import SPEC
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.testing import running, service_app

ADMIN_EMAIL = "op@platform.test"
ADMIN_PASSWORD = "operator-password-1"
PASSWORD = "correct horse battery"
# The test's stand-in for a public address: allowed by the operator setting, like a real IdP's.
IDP_HOST = "127.0.0.2"


class LoopbackDns:
    """An authoritative DNS server on 127.0.0.1:<port> for the records in `zone` (name -> type -> values)."""

    def __init__(self) -> None:
        self.zone: dict[str, dict[str, list[str]]] = {}
        self.queries: list[tuple[str, str]] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._stopped = False

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, rdtype: str, *values: str) -> None:
        self.zone.setdefault(name.lower().rstrip("."), {})[rdtype] = list(values)

    def start(self) -> LoopbackDns:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped = True
        self.sock.close()

    def _serve(self) -> None:
        while not self._stopped:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            try:
                query = dns.message.from_wire(data)
            except Exception:  # junk on the socket: ignore it
                continue
            response = dns.message.make_response(query)
            response.flags |= dns.flags.AA
            q = query.question[0]
            name = q.name.to_text().lower().rstrip(".")
            rdtype = dns.rdatatype.to_text(q.rdtype)
            self.queries.append((name, rdtype))
            records = self.zone.get(name)
            if records is None:
                response.set_rcode(dns.rcode.NXDOMAIN)
            elif values := records.get(rdtype):
                text = [f'"{v}"' for v in values] if rdtype == "TXT" else values
                response.answer.append(dns.rrset.from_text_list(q.name, 60, dns.rdataclass.IN, rdtype, text))
            self.sock.sendto(response.to_wire(), peer)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Servers:
    """Real TCP servers on loopback addresses; `hits` counts connections per port."""

    servers: list[asyncio.Server] = field(default_factory=list)
    hits: dict[int, int] = field(default_factory=dict)
    requests: dict[int, list[bytes]] = field(default_factory=dict)

    async def start(self, host: str, handler: Handler) -> int:
        port_box: list[int] = []

        async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.hits[port_box[0]] = self.hits.get(port_box[0], 0) + 1
            try:
                await handler(reader, writer)
            finally:
                writer.close()

        server = await asyncio.start_server(counted, host, 0)
        port_box.append(server.sockets[0].getsockname()[1])
        self.servers.append(server)
        return port_box[0]

    async def http(self, host: str, respond: Callable[[bytes], tuple[int, dict[str, str], bytes]]) -> int:
        """An HTTP/1.1 server answering every request with `respond(request_head)`."""
        box: list[int] = []

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            self.requests.setdefault(box[0], []).append(head)
            lines_in = head.split(b"\r\n")
            length = next((int(ln.split(b":")[1]) for ln in lines_in if ln.lower().startswith(b"content-length")), 0)
            if length:
                await reader.readexactly(length)
            status, headers, body = respond(head)
            lines = [f"HTTP/1.1 {status} X", f"content-length: {len(body)}", "connection: close"]
            lines += [f"{k}: {v}" for k, v in headers.items()]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
            await writer.drain()

        port = await self.start(host, handler)
        box.append(port)
        return port

    async def close(self) -> None:
        for s in self.servers:
            s.close()
            await s.wait_closed()


def closed_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on (bound then released)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class IdentityUnderTest:
    client: httpx.AsyncClient
    kit: KitRuntime

    async def token(self, email: str, password: str) -> str:
        r = await self.client.post(
            "/auth/token", data={"grant_type": "password", "username": email, "password": password}
        )
        assert r.status_code == 200, r.text
        return str(r.json()["access_token"])

    async def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {await self.token(ADMIN_EMAIL, ADMIN_PASSWORD)}"}

    async def tenant(self) -> dict[str, Any]:
        """A fresh tenant with a tenant admin; the operator's and the tenant admin's headers."""
        op = await self.admin()
        slug = f"t-{uuid.uuid4().hex[:8]}"
        t = await self.client.post("/tenants", json={"slug": slug, "name": slug}, headers=op)
        assert t.status_code == 201, t.text
        tid = t.json()["tenant_id"]
        email = f"admin@{slug}.example"
        u = await self.client.post(
            f"/tenants/{tid}/users", json={"email": email, "password": PASSWORD, "role": "tenant_admin"}, headers=op
        )
        assert u.status_code == 201, u.text
        admin = {"Authorization": f"Bearer {await self.token(email, PASSWORD)}"}
        return {"tenant_id": tid, "slug": slug, "op": op, "admin": admin}


@asynccontextmanager
async def identity_app(admin_url: str, bootstrap: str, **overrides: Any) -> AsyncIterator[IdentityUnderTest]:
    """identity in process (real schema, real broker) with the production outbound defaults, except
    `IDP_HOST` allowed (and over plain http), and whatever the test overrides."""
    settings: dict[str, Any] = {
        "public_url": "http://test-issuer/api/identity",
        "bootstrap_admin_email": ADMIN_EMAIL,
        "bootstrap_admin_password": ADMIN_PASSWORD,
        "source_threshold": 10000,
        "idp_allowed_networks": [f"{IDP_HOST}/32"],
        "idp_plain_http_hosts": [IDP_HOST],
        "idp_timeout_s": 3.0,
        "idp_max_response_bytes": 64 * 1024,
        **overrides,
    }
    app = await service_app(SPEC, admin_url, bootstrap, **settings)
    async with running(app) as (client, kit):
        kit.verifier.jwks.set((await client.get("/.well-known/jwks.json")).json())
        yield IdentityUnderTest(client, kit)
