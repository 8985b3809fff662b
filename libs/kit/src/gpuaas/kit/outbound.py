"""Outbound HTTP to URLs that tenants supply (their identity providers' discovery, JWKS and token
endpoints): only to addresses the operator allows, so such a URL cannot make a service reach inside
the platform's network (server-side request forgery).

- The host is resolved once and *every* answer is checked; the connection then goes to a checked
  address (the transport pins it), so DNS that answers differently a second time (rebinding) gains
  nothing. The URL's host name is kept for the Host header, TLS SNI and certificate checks.
- Denied unless the operator allows them (`allowed_networks`): loopback, private, link-local,
  shared (CGNAT), multicast, reserved and unspecified addresses, their IPv6 equivalents, and IPv6
  forms that embed an IPv4 address (mapped, 6to4, Teredo, NAT64) by the address they embed.
- HTTPS only, except hosts the operator names (`plain_http_hosts`, the devstack's loopback IdP).
- No redirects are followed (a 3xx is a failure), short timeouts, an overall deadline and a cap on
  the response body's size.

Every failure is one `OutboundError` whose `reason` is for the operator's log only: callers answer
their clients with one generic problem, so the answer never tells a closed port, a non-HTTP service
and an HTTP service apart.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx
from httpcore import AsyncNetworkBackend, AsyncNetworkStream
from httpcore._backends.auto import AutoBackend

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# A resolver: host name -> the addresses it names (the operator's DNS servers, or the system's).
Resolver = Callable[[str], Awaitable[list[str]]]

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_CGNAT = ipaddress.IPv4Network("100.64.0.0/10")


class OutboundError(Exception):
    """The fetch was refused or failed. `reason` is a short code for logs, never for a client."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class OutboundPolicy:
    # CIDRs the operator allows although they are denied by default (e.g. 127.0.0.1/32 for a devstack IdP).
    allowed_networks: Sequence[str] = ()
    # host or host:port reachable over plain http (everything else must be https).
    plain_http_hosts: Sequence[str] = ()
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 5.0
    # Whole request, headers and body: a server dripping bytes cannot hold a worker longer.
    deadline_s: float = 10.0
    max_body_bytes: int = 1 << 20
    resolver: Resolver | None = field(default=None, compare=False)

    def networks(self) -> list[IPNetwork]:
        return [ipaddress.ip_network(n, strict=False) for n in self.allowed_networks]


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def denied_by_default(ip: IPAddress) -> bool:
    """True for every address that is not a public unicast one (and for IPv6 forms of such)."""
    if isinstance(ip, ipaddress.IPv6Address) and (v4 := _embedded_ipv4(ip)) is not None:
        return denied_by_default(v4)
    if isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT:
        return True
    return (
        not ip.is_global
        or ip.is_multicast
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_private
        or ip.is_reserved
        or ip.is_unspecified
    )


def address_allowed(ip: IPAddress, allowed: Iterable[IPNetwork]) -> bool:
    return any(ip.version == n.version and ip in n for n in allowed) or not denied_by_default(ip)


async def system_resolver(host: str) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def checked_addresses(host: str, policy: OutboundPolicy) -> list[str]:
    """The addresses `host` names, all of them allowed (one denied answer refuses the host)."""
    try:
        literal: IPAddress | None = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        literal = None
    if literal is not None:
        answers = [str(literal)]
    else:
        try:
            answers = await (policy.resolver or system_resolver)(host)
        except (OSError, UnicodeError, ValueError) as exc:
            raise OutboundError("resolve_failed", f"{host}: {exc.__class__.__name__}") from exc
        except Exception as exc:  # dnspython's NXDOMAIN, NoAnswer, timeouts ...
            raise OutboundError("resolve_failed", f"{host}: {exc.__class__.__name__}") from exc
    if not answers:
        raise OutboundError("resolve_failed", f"{host}: no address")
    allowed = policy.networks()
    for answer in answers:
        ip = ipaddress.ip_address(answer.split("%", 1)[0])
        if not address_allowed(ip, allowed):
            raise OutboundError("address_denied", f"{host} -> {ip}")
    return answers


class _PinnedBackend(AsyncNetworkBackend):
    """httpcore's network backend, connecting only to checked addresses of the requested host."""

    def __init__(self, policy: OutboundPolicy) -> None:
        self.policy = policy
        self._inner = AutoBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> AsyncNetworkStream:
        last: Exception | None = None
        for address in await checked_addresses(host, self.policy):
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        raise OutboundError("connect_failed", f"{host}:{port}: {last.__class__.__name__}")

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> AsyncNetworkStream:
        raise OutboundError("address_denied", "unix sockets are never reached")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class PinnedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over `_PinnedBackend`; never a proxy (one would connect on our behalf)."""

    def __init__(self, policy: OutboundPolicy) -> None:
        super().__init__(trust_env=False)
        ssl_context = httpx.create_ssl_context(trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context, max_connections=4, network_backend=_PinnedBackend(policy)
        )


def check_url(url: str, policy: OutboundPolicy) -> None:
    """Scheme and shape only (the address is checked at connect time)."""
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise OutboundError("url_denied", "not an absolute http(s) URL")
    if parts.username is not None or parts.password is not None:
        raise OutboundError("url_denied", "credentials in the URL")
    if parts.scheme == "http" and not plain_http_allowed(parts.netloc, policy.plain_http_hosts):
        raise OutboundError("url_denied", f"plain http to {parts.netloc}")


# Compressed bodies are not asked for: the size cap counts raw bytes, and a small gzip can inflate hugely.
_HEADERS = {"Accept": "application/json", "Accept-Encoding": "identity"}


def plain_http_allowed(netloc: str, hosts: Iterable[str]) -> bool:
    host = urlsplit(f"//{netloc}").hostname or ""
    return any(h.lower() in (netloc.lower(), host) for h in hosts)


async def fetch_json(
    policy: OutboundPolicy,
    method: str,
    url: str,
    *,
    data: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """(status, parsed JSON body) of one request under `policy`. A 3xx, a body over the cap, a body
    that is not JSON, or any network failure is an `OutboundError`; other statuses are the caller's."""
    check_url(url, policy)
    timeout = httpx.Timeout(policy.read_timeout_s, connect=policy.connect_timeout_s)
    try:
        async with (
            asyncio.timeout(policy.deadline_s),
            httpx.AsyncClient(
                transport=PinnedTransport(policy), timeout=timeout, follow_redirects=False, trust_env=False
            ) as client,
            client.stream(method, url, data=data, headers={**_HEADERS, **(headers or {})}) as resp,
        ):
            if resp.is_redirect or 300 <= resp.status_code < 400:
                raise OutboundError("redirect", f"{resp.status_code} from {url}")
            if int(resp.headers.get("content-length") or 0) > policy.max_body_bytes:
                raise OutboundError("too_large", f"content-length {resp.headers['content-length']}")
            body = bytearray()
            async for chunk in resp.aiter_raw():
                body += chunk
                if len(body) > policy.max_body_bytes:
                    raise OutboundError("too_large", f"over {policy.max_body_bytes} bytes")
            status = resp.status_code
            encoding = resp.headers.get("content-encoding", "identity")
    except TimeoutError as exc:
        raise OutboundError("timeout", url) from exc
    except httpx.HTTPError as exc:
        raise OutboundError("http_failed", f"{url}: {exc.__class__.__name__}") from exc
    if encoding not in ("identity", ""):  # raw bytes were counted: compressed bodies are refused, not inflated
        raise OutboundError("not_json", f"content-encoding {encoding}")
    try:
        return status, json.loads(bytes(body))
    except ValueError as exc:
        raise OutboundError("not_json", f"{url}: {exc.__class__.__name__}") from exc
