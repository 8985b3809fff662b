"""The verified-token cache (tokens.py): a hit only while the token is unexpired and the JWKS unchanged."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
import pytest
from joserfc import jwt
from joserfc.jwk import ECKey

from gpuaas.gateway.tokens import CachedVerifier
from gpuaas.kit.auth import CLOCK_SKEW_LEEWAY_S, JWKSCache, TokenVerifier
from gpuaas.kit.errors import Unauthorized

ISSUER = "http://gateway.test/api/identity"
AUDIENCE = "gpuaas"


class Issuer:
    def __init__(self) -> None:
        self.keys: list[ECKey] = []

    def add_key(self, kid: str) -> None:
        self.keys.append(ECKey.generate_key("P-256", parameters={"kid": kid, "alg": "ES256", "use": "sig"}))

    def jwks(self) -> dict[str, Any]:
        return {"keys": [k.as_dict(private=False) for k in self.keys]}

    def token(self, *, kid: str = "k1", exp_in: int = 300, **claims: Any) -> str:
        key = next(k for k in self.keys if k.kid == kid)
        now = int(time.time())
        body = {"sub": str(uuid.uuid4()), "iss": ISSUER, "aud": AUDIENCE, "iat": now, "exp": now + exp_in} | claims
        return jwt.encode({"alg": "ES256", "kid": kid}, body, key)


def verifier(issuer: Issuer, max_entries: int = 100) -> CachedVerifier:
    jwks = JWKSCache("http://127.0.0.1:9/unused", ttl_s=3600)
    jwks.set(issuer.jwks())
    return CachedVerifier(TokenVerifier(jwks, ISSUER, AUDIENCE), max_entries=max_entries)


@pytest.fixture
def issuer() -> Issuer:
    i = Issuer()
    i.add_key("k1")
    return i


async def test_a_verified_token_is_answered_from_the_cache(issuer):
    v = verifier(issuer)
    token = issuer.token()
    first = await v.verify(token)
    second = await v.verify(token)
    assert second == first
    assert (v.misses, v.hits) == (1, 1)


async def test_refusals_are_not_cached(issuer):
    v = verifier(issuer)
    bad = issuer.token(aud="someone-else")
    for _ in range(2):
        with pytest.raises(Unauthorized):
            await v.verify(bad)
    assert (v.misses, v.hits, len(v)) == (2, 0, 0)


async def test_a_cached_token_stops_working_when_it_expires(issuer):
    v = verifier(issuer)
    token = issuer.token(exp_in=2 - CLOCK_SKEW_LEEWAY_S)  # valid for 2 more seconds, with the leeway
    await v.verify(token)
    await asyncio.sleep(2.1)
    with pytest.raises(Unauthorized):
        await v.verify(token)


async def test_a_jwks_refresh_drops_tokens_of_a_removed_key(issuer):
    v = verifier(issuer)
    token = issuer.token(kid="k1")
    await v.verify(token)
    issuer.keys.clear()
    issuer.add_key("k2")
    v.jwks.set(issuer.jwks())  # what a refresh does: k1 is gone
    with pytest.raises(Unauthorized):
        await v.verify(token)
    fresh = issuer.token(kid="k2")
    await v.verify(fresh)
    assert await v.verify(fresh) is not None and v.hits == 1


async def test_the_cache_is_bounded_least_recently_used_first(issuer):
    v = verifier(issuer, max_entries=2)
    a, b, c = (issuer.token() for _ in range(3))
    await v.verify(a)
    await v.verify(b)
    await v.verify(a)  # a is now the most recent
    await v.verify(c)  # evicts b
    assert len(v) == 2
    hits = v.hits
    await v.verify(a)
    assert v.hits == hits + 1
    await v.verify(b)
    assert v.hits == hits + 1  # b had to be verified again


async def test_through_the_gateway_an_expired_cached_token_is_refused(stack):
    gateway = await stack.gateway()
    headers = stack.bearer(exp_in=2 - CLOCK_SKEW_LEEWAY_S)  # valid for 2 more seconds, with the leeway
    async with httpx.AsyncClient(base_url=gateway) as client:
        before = [await client.get("/api/catalog/echo", headers=headers) for _ in range(3)]
        await asyncio.sleep(2.1)
        after = await client.get("/api/catalog/echo", headers=headers)
    assert [r.status_code for r in before] == [200, 200, 200]
    assert after.status_code == 401
    assert after.json()["code"] == "invalid_token"
