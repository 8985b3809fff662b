"""Tenants' enterprise identity providers as seen by identity, their relying party: the discovery
document and JWKS (cached), the authorization-code exchange and ID token verification.

Every function here talks to the network: callers run them between transactions, never in one.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet

from gpuaas.kit.errors import Problem


class IdpError(Problem):
    status, code, title = 502, "idp_error", "Identity provider error"


class IdpMetadata:
    """The IdP's discovery document and JWKS, cached per issuer for a few minutes."""

    def __init__(self, timeout_s: float, ttl_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._docs: dict[str, tuple[float, dict[str, Any]]] = {}
        self._jwks: dict[str, tuple[float, KeySet]] = {}

    async def document(self, issuer: str) -> dict[str, Any]:
        hit = self._docs.get(issuer)
        if hit and time.monotonic() - hit[0] < self.ttl_s:
            return hit[1]
        doc = await self._get_json(f"{issuer}/.well-known/openid-configuration")
        if doc.get("issuer", "").rstrip("/") != issuer:
            raise IdpError("the identity provider's discovery document names another issuer")
        self._docs[issuer] = (time.monotonic(), doc)
        return doc

    async def keys(self, issuer: str, *, refresh: bool = False) -> KeySet:
        hit = self._jwks.get(issuer)
        if hit and not refresh and time.monotonic() - hit[0] < self.ttl_s:
            return hit[1]
        doc = await self.document(issuer)
        keyset = KeySet.import_key_set(await self._get_json(doc["jwks_uri"]))
        self._jwks[issuer] = (time.monotonic(), keyset)
        return keyset

    async def _get_json(self, url: str) -> dict[str, Any]:
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                resp = await client.get(url)
                resp.raise_for_status()
                return resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise IdpError(
                f"the identity provider is unreachable or answered badly ({exc.__class__.__name__})"
            ) from exc


async def exchange_code(token_endpoint: str, form: dict[str, str], timeout_s: float) -> str:
    """The IdP's authorization code for its ID token (the raw JWT, not yet verified)."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            resp = await http.post(token_endpoint, data=form)
    except httpx.HTTPError as exc:
        raise IdpError(f"the identity provider's token endpoint failed ({exc.__class__.__name__})") from exc
    if resp.status_code != 200 or "id_token" not in resp.text:
        raise IdpError(f"the identity provider did not issue an ID token (HTTP {resp.status_code})")
    id_token: str = resp.json()["id_token"]
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
