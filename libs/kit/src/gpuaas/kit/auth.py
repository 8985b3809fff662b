"""JWT verification against the identity JWKS, and the authenticated `Principal`.

The JWKS is cached; a token signed with an unknown `kid` triggers one refresh (rate-limited), so key
rotation needs no restart and old keys keep working for as long as identity publishes them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, cast

import httpx
from fastapi import Depends
from joserfc import jws, jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet, KeySetSerialization
from starlette.requests import HTTPConnection

from gpuaas.contracts import Actor, ActorKind
from gpuaas.kit.errors import Unauthorized, Unavailable
from gpuaas.kit.logging import get_logger
from gpuaas.kit.revocation import DenyList

log = get_logger(__name__)
ALGORITHMS = ["ES256", "RS256"]
QUERY_TOKEN_SUFFIXES = ("/stream", "/events", "/terminal")


@dataclass(frozen=True)
class Principal:
    """Who is calling. Authorization comes from the IAM projection, not from token claims."""

    subject: uuid.UUID
    kind: ActorKind
    tenant_id: uuid.UUID | None = None
    project_id: uuid.UUID | None = None  # service accounts only
    scopes: frozenset[str] = field(default_factory=frozenset)
    token_id: str | None = None
    email: str | None = None
    # What revocation checks (gpuaas.kit.revocation): the login session (`sid`), issue and expiry times (epoch s).
    session_id: uuid.UUID | None = None
    issued_at: float | None = None
    expires_at: float | None = None

    @property
    def actor(self) -> Actor:
        return Actor(kind=self.kind, id=str(self.subject))

    @property
    def is_service_account(self) -> bool:
        return self.kind is ActorKind.service_account


class JWKSCache:
    def __init__(
        self,
        url: str,
        ttl_s: float = 300.0,
        min_refresh_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,  # injectable: tests move time by hand
    ) -> None:
        self.url = url
        self._clock = clock
        self.ttl_s = ttl_s
        self.min_refresh_interval_s = min_refresh_interval_s
        self._keys: KeySet | None = None
        self._fetched_at = 0.0
        self._lock = asyncio.Lock()

    async def keys(self, *, want_kid: str | None = None) -> KeySet:
        now = self._clock()
        stale = self._keys is None or now - self._fetched_at > self.ttl_s
        missing = want_kid is not None and self._keys is not None and not _has_kid(self._keys, want_kid)
        if stale or (missing and now - self._fetched_at > self.min_refresh_interval_s):
            async with self._lock:
                if self._fetched_at == 0.0 or self._clock() - self._fetched_at > self.min_refresh_interval_s:
                    await self._refresh()
        if self._keys is None:
            # Not the caller's fault: a 401 would make clients drop a perfectly good session.
            raise Unavailable("token keys cannot be fetched from identity yet; retry shortly", code="jwks_unavailable")
        return self._keys

    def set(self, keys: dict[str, Any]) -> None:
        self._keys = KeySet.import_key_set(cast(KeySetSerialization, keys))  # validated by import_key_set
        self._fetched_at = self._clock()

    async def _refresh(self) -> None:
        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                resp = await client.get(self.url)
                resp.raise_for_status()
                self.set(resp.json())
        except (httpx.HTTPError, ValueError) as exc:
            log.warning("jwks_fetch_failed", url=self.url, error=str(exc))
            self._fetched_at = self._clock()  # back off; keep serving the old keys


def _has_kid(keys: KeySet, kid: str) -> bool:
    return any(k.kid == kid for k in keys.keys)


# Clock skew tolerated between identity (which stamps iat/nbf/exp) and a verifying service: a token
# minted on a clock a little ahead is not refused as "not yet valid" (RFC 7519 4.1.4-4.1.6 allow "a few
# minutes"; 30 s is enough for NTP-synchronised hosts and adds at most that to a 15-minute token's life).
CLOCK_SKEW_LEEWAY_S = 30


class TokenVerifier:
    """Signature, issuer, audience and expiry, then the deny list (`revocations`: a revoked session, a
    disabled account, a rotated service-account secret), in memory: no I/O per request."""

    def __init__(self, jwks: JWKSCache, issuer: str, audience: str, revocations: DenyList | None = None) -> None:
        self.jwks = jwks
        self.revocations = revocations
        self.claims = jwt.JWTClaimsRegistry(
            leeway=CLOCK_SKEW_LEEWAY_S,
            iss={"essential": True, "value": issuer},
            aud={"essential": True, "value": audience},
            exp={"essential": True},
            sub={"essential": True},
        )

    async def verify(self, token: str) -> Principal:
        try:
            header = jws.extract_compact(token.encode()).headers()
        except (JoseError, ValueError):
            raise Unauthorized("malformed token", code="invalid_token") from None
        keys = await self.jwks.keys(want_kid=header.get("kid"))
        try:
            decoded = jwt.decode(token, keys, algorithms=ALGORITHMS)
            self.claims.validate(decoded.claims)
        except (JoseError, ValueError) as exc:
            raise Unauthorized(f"invalid token: {exc.__class__.__name__}", code="invalid_token") from exc
        principal = principal_from_claims(decoded.claims)
        if self.revocations is not None:
            self.revocations.check(principal)
        return principal


def principal_from_claims(claims: dict[str, Any]) -> Principal:
    try:
        kind = ActorKind(claims.get("typ", "user"))
        return Principal(
            subject=uuid.UUID(claims["sub"]),
            kind=kind,
            tenant_id=uuid.UUID(claims["tenant_id"]) if claims.get("tenant_id") else None,
            project_id=uuid.UUID(claims["project_id"]) if claims.get("project_id") else None,
            scopes=frozenset(str(claims.get("scope", "")).split()),
            token_id=claims.get("jti"),
            email=claims.get("email"),
            session_id=uuid.UUID(claims["sid"]) if claims.get("sid") else None,
            issued_at=_numeric(claims.get("iat")),
            expires_at=_numeric(claims.get("exp")),
        )
    except (KeyError, ValueError) as exc:
        raise Unauthorized("token claims are incomplete", code="invalid_token") from exc


def _numeric(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def bearer_token(request: HTTPConnection) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value:
        return value.strip()
    # Browsers cannot set headers on EventSource/WebSocket: those paths may carry the token in the query.
    if request.url.path.endswith(QUERY_TOKEN_SUFFIXES):
        return request.query_params.get("access_token")
    return None


async def current_principal(request: HTTPConnection) -> Principal:
    """The verified caller of an HTTP request or a WebSocket (both are HTTP connections)."""
    token = bearer_token(request)
    if not token:
        raise Unauthorized("a bearer token is required", code="missing_token")
    verifier: TokenVerifier = request.app.state.kit.verifier
    principal = await verifier.verify(token)
    request.state.principal = principal
    return principal


CurrentPrincipal = Annotated[Principal, Depends(current_principal)]
