"""What the gateway decides before forwarding: is the path public, who is calling (JWT), are they
within their rate limit, and which headers go upstream.

Shared by the HTTP proxy and the WebSocket bridge. Refusals are raised as kit `Problem`s and
rendered with `render_problem` (401s carry `WWW-Authenticate`, 429s an exact `Retry-After`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from gpuaas.gateway.runtime import GatewayRuntime
from gpuaas.gateway.upstreams import Upstream, is_public, segments
from gpuaas.kit import context
from gpuaas.kit.auth import Principal
from gpuaas.kit.client_address import client_address, forwarded_chain, is_trusted
from gpuaas.kit.errors import NotFound, Problem, TooManyRequests, Unauthorized, Unavailable, problem_response
from gpuaas.kit.logging import get_logger

log = get_logger(__name__)

# Browsers cannot set headers on EventSource/WebSocket: these may carry ?access_token=.
QUERY_TOKEN_LEAVES = frozenset({"stream", "events", "terminal"})

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_FORWARDED = frozenset({"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x-correlation-id", "host"})
# Headers that claim where a request came from: only the gateway says that to a service (it sets
# X-Forwarded-For/-Proto/-Host itself), so a client's own are never passed on (issue 28).
CLIENT_FORWARDING = frozenset({"forwarded", "x-real-ip", "x-client-ip", "true-client-ip", "x-original-forwarded-for"})


def is_forwarding_header(name: str) -> bool:
    """A header (lower-case name) by which a client could claim another origin: Forwarded, X-Forwarded-*..."""
    return name in CLIENT_FORWARDING or name.startswith("x-forwarded-")


class RateLimited(TooManyRequests):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__(
            f"Rate limit exceeded; retry in {retry_after_s}s.", code="rate_limited", retry_after_s=retry_after_s
        )
        self.retry_after_s = retry_after_s


class BadPath(Problem):
    status, code, title = 400, "invalid_path", "Invalid path"


@dataclass(frozen=True)
class Admission:
    principal: Principal | None
    client_ip: str
    query_token: str | None  # the token came as ?access_token= (forwarded upstream as a header instead)


def check_path(path: str) -> None:
    """Dot segments could make the public-path check and the upstream disagree: refuse them."""
    if any(p in (".", "..") for p in path.split("/")):
        raise BadPath("Paths with '.' or '..' segments are not accepted.")


def find_token(headers: Mapping[str, str], query: Mapping[str, str], rest: str) -> tuple[str | None, bool]:
    """(token, came_from_query). The header wins over the query parameter."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip(), False
    parts = segments(rest)
    if parts and parts[-1] in QUERY_TOKEN_LEAVES and (token := query.get("access_token")):
        return token, True
    return None, False


def client_ip(peer: str | None, forwarded_for: str | None, trusted: Iterable[str]) -> str:
    """The caller's address: the peer, or, behind a trusted proxy, the right-most untrusted X-Forwarded-For hop."""
    return client_address(peer, forwarded_for, trusted)


async def admit(
    rt: GatewayRuntime,
    upstream: Upstream,
    rest: str,
    headers: Mapping[str, str],
    query: Mapping[str, str],
    peer: str | None,
    method: str = "GET",
) -> Admission:
    """Authenticate (unless public) and rate-limit one request or WebSocket upgrade."""
    check_path(rest)
    if segments(rest) == ["metrics"]:  # a service's metrics are for the in-cluster scraper, not the API
        raise NotFound("No route at this path.", code="not_found")
    ip = client_ip(peer, headers.get("x-forwarded-for"), rt.settings.trusted_proxies)
    principal: Principal | None = None
    query_token: str | None = None
    # A CORS preflight never carries credentials; the upstream answers it.
    preflight = method == "OPTIONS" and "access-control-request-method" in headers
    if not (preflight or is_public(upstream, rest)):
        token, from_query = find_token(headers, query, rest)
        try:
            if token is None:
                raise Unauthorized("A bearer token is required.", code="missing_token")
            principal = await rt.verifier.verify(token)
        except Unavailable as exc:  # the kit's JWKS cache has no keys: not the caller's fault
            detail = "Token keys cannot be fetched from identity; retry shortly."
            raise Unavailable(detail, code="auth_unavailable") from exc
        except Unauthorized as exc:
            rt.metrics.auth_rejected.labels(exc.code).inc()
            _limit(rt, f"ip:{ip}")  # failed attempts count against the address
            raise
        if from_query:
            query_token = token
    _limit(rt, f"sub:{principal.subject}" if principal else f"ip:{ip}")
    return Admission(principal, ip, query_token)


def _limit(rt: GatewayRuntime, key: str) -> None:
    decision = rt.limiter.take(key)
    if not decision.allowed:
        rt.metrics.rate_limited.inc()
        raise RateLimited(decision.retry_after_s)


def render_problem(exc: Problem, instance: str) -> JSONResponse:
    resp = problem_response(exc.status, exc.code, exc.title, exc.detail, instance, **exc.extra)
    if isinstance(exc, RateLimited):
        resp.headers["Retry-After"] = str(exc.retry_after_s)
    if exc.status == 401:
        resp.headers["WWW-Authenticate"] = (
            'Bearer realm="gpuaas"' if exc.code == "missing_token" else 'Bearer realm="gpuaas", error="invalid_token"'
        )
    return resp


def _connection_tokens(raw: Iterable[tuple[bytes, bytes]]) -> set[str]:
    tokens: set[str] = set()
    for k, v in raw:
        if k.lower() == b"connection":
            tokens.update(t.strip().lower() for t in v.decode("latin-1").split(",") if t.strip())
    return tokens


def upstream_request_headers(
    raw: Iterable[tuple[bytes, bytes]],
    *,
    peer: str | None,
    scheme: str,
    trusted: Iterable[str],
    query_token: str | None,
    drop: frozenset[str] = frozenset(),
) -> list[tuple[str, str]]:
    """The client's headers minus hop-by-hop ones, plus X-Forwarded-* and X-Correlation-ID.

    X-Forwarded-For is the chain cut to start at the client's address (`forwarded_chain`): hops a client
    wrote itself never reach a service (whose audit records and login throttle read the chain); from a
    peer that is not a trusted proxy, only the peer. X-Forwarded-Proto/-Host are believed only from a
    trusted proxy. Every other forwarding header (Forwarded, X-Real-IP, X-Forwarded-Port/-Prefix...) is
    dropped: a service reads the client's origin only from what the gateway set.

    Authorization passes through unchanged; a token that came as ?access_token= is sent as a header.
    """
    raw = list(raw)
    skip = HOP_BY_HOP | _connection_tokens(raw) | drop
    out: list[tuple[str, str]] = []
    seen: dict[str, list[str]] = {}
    for k, v in raw:
        name, value = k.decode("latin-1").lower(), v.decode("latin-1")
        if name in _FORWARDED:
            seen.setdefault(name, []).append(value)
        elif name not in skip and not is_forwarding_header(name):
            out.append((name, value))
    host = (seen.get("host") or [""])[0]
    trusted_peer = is_trusted(peer, trusted)
    chain = forwarded_chain(peer, seen.get("x-forwarded-for", []), trusted)
    proto = "https" if scheme in ("https", "wss") else "http"
    if trusted_peer:
        proto = (seen.get("x-forwarded-proto") or [proto])[0]
        host = (seen.get("x-forwarded-host") or [host])[0]
    out += [("x-forwarded-for", ", ".join(chain)), ("x-forwarded-proto", proto)]
    if host:
        out.append(("x-forwarded-host", host))
    if cid := context.correlation_id.get():
        out.append(("x-correlation-id", cid))
    if query_token and not any(n == "authorization" for n, _ in out):
        out.append(("authorization", f"Bearer {query_token}"))
    return out


_RESPONSE_DROP = frozenset({"x-correlation-id", "date", "server"})  # ours replace them


def downstream_response_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    raw = list(raw)
    skip = HOP_BY_HOP | _connection_tokens(raw) | _RESPONSE_DROP
    return [(k.lower(), v) for k, v in raw if k.decode("latin-1").lower() not in skip]


def log_fields(upstream: Upstream, admission: Admission | None) -> dict[str, Any]:
    fields: dict[str, Any] = {"service": upstream.name}
    if admission and admission.principal:
        fields["actor"] = str(admission.principal.subject)
        if admission.principal.tenant_id:
            fields["tenant_id"] = str(admission.principal.tenant_id)
    return fields
