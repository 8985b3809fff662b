"""JWKSCache refetch throttling: a token with an unknown `kid` (a rotated key, or garbage) triggers at
most one JWKS fetch per `min_refresh_interval_s`, however many such tokens arrive, alone or at once;
a known kid never refetches before the TTL; a failing identity is not hammered either.

The cache's clock is replaced by a fake one (no sleeping); the JWKS is served over real HTTP by a tiny
local server that counts the fetches.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from joserfc import jwt
from joserfc.jwk import ECKey

from gpuaas.kit import auth
from gpuaas.kit.errors import Unauthorized, Unavailable

INTERVAL_S = 5.0
TTL_S = 300.0


class FakeClock:
    """The cache's monotonic clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 10_000.0  # not 0.0: the cache reads a fetch time of 0.0 as "never fetched"

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class JwksServer:
    """Serves one JWK Set (or a 500) over HTTP/1.1 and counts the requests."""

    keys: dict[str, Any]
    status: int = 200
    fetches: int = 0
    url: str = ""
    _server: asyncio.Server | None = field(default=None, repr=False)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.fetches += 1
        body = json.dumps(self.keys).encode() if self.status == 200 else b"{}"
        reason = "OK" if self.status == 200 else "Internal Server Error"
        writer.write(
            f"HTTP/1.1 {self.status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/.well-known/jwks.json"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def new_key() -> ECKey:
    return ECKey.generate_key("P-256", parameters={"kid": uuid.uuid4().hex[:16], "alg": "ES256", "use": "sig"})


def token_signed_by(key: ECKey) -> str:
    now = int(time.time())
    claims = {"iss": "iss", "aud": "gpuaas", "sub": str(uuid.uuid4()), "iat": now, "exp": now + 60}
    return jwt.encode({"alg": "ES256", "kid": key.kid}, claims, key)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def served() -> AsyncIterator[tuple[JwksServer, ECKey]]:
    key = new_key()
    server = JwksServer(keys={"keys": [key.as_dict(private=False)]})
    await server.start()
    try:
        yield server, key
    finally:
        await server.stop()


def cache_for(server: JwksServer, clock: FakeClock) -> auth.JWKSCache:
    return auth.JWKSCache(server.url, ttl_s=TTL_S, min_refresh_interval_s=INTERVAL_S, clock=clock.monotonic)


async def test_unknown_kid_refetches_at_most_once_per_interval(
    clock: FakeClock, served: tuple[JwksServer, ECKey]
) -> None:
    server, key = served
    cache = cache_for(server, clock)
    await cache.keys(want_kid=key.kid)
    assert server.fetches == 1  # the first use fetches

    # Tokens with kids the JWKS does not have, again and again within the interval: no refetch.
    for _ in range(50):
        keys = await cache.keys(want_kid=uuid.uuid4().hex)
        assert any(k.kid == key.kid for k in keys.keys)  # the cached keys keep being served
        clock.advance(0.05)
    assert server.fetches == 1

    # Once the interval has passed, one unknown kid refetches once; the ones right after do not.
    clock.advance(INTERVAL_S)
    for _ in range(20):
        await cache.keys(want_kid="still-unknown")
    assert server.fetches == 2


async def test_concurrent_unknown_kids_share_one_refetch(clock: FakeClock, served: tuple[JwksServer, ECKey]) -> None:
    server, key = served
    cache = cache_for(server, clock)
    await cache.keys(want_kid=key.kid)
    clock.advance(INTERVAL_S + 1)
    await asyncio.gather(*(cache.keys(want_kid=f"unknown-{i}") for i in range(25)))
    assert server.fetches == 2


async def test_known_kid_is_served_from_the_cache_until_the_ttl(
    clock: FakeClock, served: tuple[JwksServer, ECKey]
) -> None:
    server, key = served
    cache = cache_for(server, clock)
    for _ in range(10):
        await cache.keys(want_kid=key.kid)
        clock.advance(TTL_S / 20)
    assert server.fetches == 1
    clock.advance(TTL_S)
    await cache.keys(want_kid=key.kid)
    assert server.fetches == 2  # stale after the TTL: refreshed once


async def test_rotated_key_is_picked_up_after_the_interval(clock: FakeClock, served: tuple[JwksServer, ECKey]) -> None:
    """Through the verifier: a token of a key identity has just published is refused (with no new
    fetch) inside the interval and accepted after it; a forged kid costs at most one fetch per interval."""
    server, old = served
    verifier = auth.TokenVerifier(cache_for(server, clock), issuer="iss", audience="gpuaas")
    assert (await verifier.verify(token_signed_by(old))).subject
    rotated = new_key()
    server.keys = {"keys": [rotated.as_dict(private=False), old.as_dict(private=False)]}

    with pytest.raises(Unauthorized):
        await verifier.verify(token_signed_by(rotated))
    assert server.fetches == 1
    clock.advance(INTERVAL_S + 0.1)
    assert (await verifier.verify(token_signed_by(rotated))).subject
    assert server.fetches == 2

    forged = new_key()
    for _ in range(30):
        with pytest.raises(Unauthorized):
            await verifier.verify(token_signed_by(forged))
    assert server.fetches == 2
    clock.advance(INTERVAL_S + 0.1)
    for _ in range(30):
        with pytest.raises(Unauthorized):
            await verifier.verify(token_signed_by(forged))
    assert server.fetches == 3


async def test_failing_identity_is_not_hammered(clock: FakeClock, served: tuple[JwksServer, ECKey]) -> None:
    server, key = served
    server.status = 500
    cache = cache_for(server, clock)
    for _ in range(20):
        with pytest.raises(Unavailable):
            await cache.keys(want_kid=key.kid)
    assert server.fetches == 1  # a failed fetch backs off for the interval too
    clock.advance(INTERVAL_S + 0.1)
    server.status = 200
    keys = await cache.keys(want_kid=key.kid)
    assert server.fetches == 2 and any(k.kid == key.kid for k in keys.keys)
