"""Tenants' enterprise identity providers as seen by identity, their relying party: the discovery
document and JWKS (cached), the authorization-code exchange and ID token verification.

Every URL here is tenant-supplied (the issuer, and what its discovery document names), so every
request goes through the kit's outbound guard (gpuaas.kit.outbound): operator-allowed addresses
only, pinned connections, no redirects, short timeouts, a size cap. Whatever goes wrong, the caller
gets one problem, `idp_unreachable`, with a fixed text: the reason is logged for the operator and
never answered, so an issuer pointed at an internal address cannot be used to tell a closed port, a
non-HTTP service and an HTTP service apart.

Every function here talks to the network: callers run them between transactions, never in one.
"""

from __future__ import annotations

import time
from typing import Any, cast
from urllib.parse import urlsplit

from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet, KeySetSerialization

from gpuaas.kit.errors import Problem
from gpuaas.kit.logging import get_logger
from gpuaas.kit.outbound import OutboundError, OutboundPolicy, fetch_json

log = get_logger(__name__)


class IdpError(Problem):
    status, code, title = 502, "idp_error", "Identity provider error"


class IdpUnreachable(Problem):
    """The only answer for a failed fetch from an IdP, whatever failed (see the module docstring)."""

    status, code, title = 502, "idp_unreachable", "Identity provider unreachable"

    def __init__(self) -> None:
        super().__init__("the identity provider could not be used; ask your organisation's administrator")


def unreachable(issuer: str, reason: str, detail: str = "") -> IdpUnreachable:
    log.warning("idp_unreachable", issuer=issuer, reason=reason, detail=detail)
    return IdpUnreachable()


def same_origin(url: str, issuer: str) -> bool:
    a, b = urlsplit(url), urlsplit(issuer)
    return (a.scheme, a.hostname, a.port) == (b.scheme, b.hostname, b.port)


class IdpMetadata:
    """The IdP's discovery document and JWKS, cached per issuer for a few minutes."""

    def __init__(self, policy: OutboundPolicy, ttl_s: float = 300.0) -> None:
        self.policy = policy
        self.ttl_s = ttl_s
        self._docs: dict[str, tuple[float, dict[str, Any]]] = {}
        self._jwks: dict[str, tuple[float, KeySet]] = {}

    async def document(self, issuer: str) -> dict[str, Any]:
        """The discovery document, checked: it names this issuer, and its authorization endpoint is
        on the issuer's own origin (the browser is sent there: never to a third place)."""
        hit = self._docs.get(issuer)
        if hit and time.monotonic() - hit[0] < self.ttl_s:
            return hit[1]
        doc = await self.get_json(issuer, f"{issuer}/.well-known/openid-configuration")
        if str(doc.get("issuer", "")).rstrip("/") != issuer:
            raise unreachable(issuer, "issuer_mismatch", str(doc.get("issuer"))[:200])
        for key in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
            if not isinstance(doc.get(key), str):
                raise unreachable(issuer, "document_incomplete", key)
        if not same_origin(doc["authorization_endpoint"], issuer):
            raise unreachable(issuer, "authorization_endpoint_elsewhere", doc["authorization_endpoint"][:200])
        self._docs[issuer] = (time.monotonic(), doc)
        return doc

    async def keys(self, issuer: str, *, refresh: bool = False) -> KeySet:
        hit = self._jwks.get(issuer)
        if hit and not refresh and time.monotonic() - hit[0] < self.ttl_s:
            return hit[1]
        doc = await self.document(issuer)
        try:
            keyset = KeySet.import_key_set(cast(KeySetSerialization, await self.get_json(issuer, doc["jwks_uri"])))
        except (JoseError, ValueError, TypeError, KeyError) as exc:
            raise unreachable(issuer, "jwks_invalid", exc.__class__.__name__) from exc
        self._jwks[issuer] = (time.monotonic(), keyset)
        return keyset

    async def get_json(self, issuer: str, url: str) -> dict[str, Any]:
        try:
            status, body = await fetch_json(self.policy, "GET", url)
        except OutboundError as exc:
            raise unreachable(issuer, exc.reason, exc.detail) from exc
        if status != 200 or not isinstance(body, dict):
            raise unreachable(issuer, "http_status" if status != 200 else "not_an_object", str(status))
        return body

    async def exchange_code(self, issuer: str, token_endpoint: str, form: dict[str, str]) -> str:
        """The IdP's authorization code for its ID token (the raw JWT, not yet verified)."""
        try:
            status, body = await fetch_json(self.policy, "POST", token_endpoint, data=form)
        except OutboundError as exc:
            raise unreachable(issuer, exc.reason, exc.detail) from exc
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("id_token"), str):
            # A refused code (expired, replayed, wrong secret) answers like an unreachable endpoint: the
            # token endpoint is the discovery document's to name, so its answer must not be an oracle.
            raise unreachable(issuer, "token_refused", str(status))
        id_token: str = body["id_token"]
        return id_token


async def verify_id_token(
    metadata: IdpMetadata, token: str, *, issuer: str, client_id: str, nonce: str
) -> dict[str, Any]:
    registry = jwt.JWTClaimsRegistry(
        iss={"essential": True, "value": issuer},
        aud={"essential": True, "value": client_id},
        exp={"essential": True},
        sub={"essential": True},
        nonce={"essential": True, "value": nonce},
    )
    for refresh in (False, True):  # an unknown kid: the IdP rotated its keys, fetch them once more
        try:
            decoded = jwt.decode(token, await metadata.keys(issuer, refresh=refresh), algorithms=["ES256", "RS256"])
            registry.validate(decoded.claims)
            return decoded.claims
        except (JoseError, ValueError) as exc:
            if refresh:
                raise IdpError(f"the ID token is not valid ({exc.__class__.__name__})") from exc
    raise AssertionError("unreachable")
