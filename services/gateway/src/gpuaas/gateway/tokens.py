"""Verified-token cache in front of the kit's `TokenVerifier` (the JWT check was ~12 % of the gateway's CPU).

A token that verified is remembered, keyed by the token string, with its principal, its `exp` and the JWKS
key set it verified against. A later request with the same token is answered from the cache only while

- the token has not expired (the same test as the verifier: `exp` + its clock-skew leeway > now, whole
  seconds), and
- the JWKS cache still holds that same key set (a refresh, every `jwks_ttl_s`, or a rotation forced by an
  unknown `kid`, drops every entry verified against the old keys: a removed key stops working exactly when
  it would without the cache).

Refusals are never cached (every bad token is verified, counted and rate-limited as before). Revocation is
unchanged: the gateway never checked it (tokens are short-lived; identity and the services decide on
sessions and memberships), so remembering a valid signature for its remaining lifetime decides nothing
new. The cache is a bounded LRU (`max_entries`); one event loop, no locking.
"""

from __future__ import annotations

import base64
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gpuaas.kit.auth import CLOCK_SKEW_LEEWAY_S, Principal, TokenVerifier
from gpuaas.kit.errors import Unavailable


class CachedVerifier:
    def __init__(
        self,
        verifier: TokenVerifier,
        *,
        max_entries: int = 10_000,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.verifier = verifier
        self.jwks = verifier.jwks
        self.max_entries = max_entries
        self._clock = wall_clock
        self._entries: OrderedDict[str, tuple[Principal, int, Any]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def verify(self, token: str) -> Principal:
        entry = self._entries.get(token)
        if entry is not None:
            principal, exp, keys = entry
            # keys(): no fetch while the JWKS is fresh; after a refresh it is another KeySet object.
            if exp + CLOCK_SKEW_LEEWAY_S > int(self._clock()) and keys is await self.jwks.keys():
                self._entries.move_to_end(token)
                self.hits += 1
                return principal
            del self._entries[token]
        self.misses += 1
        try:
            keys = await self.jwks.keys()  # the set the verifier will use, unless it has to refresh
        except Unavailable:
            keys = None  # the verifier raises it (after a malformed token's 401, as without the cache)
        principal = await self.verifier.verify(token)
        exp = _exp(token)
        # Same set before and after: it is the one that verified the token (a refresh makes a new one).
        if exp is not None and keys is not None and keys is await self.jwks.keys():
            self._entries[token] = (principal, exp, keys)
            if len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return principal


def _exp(token: str) -> int | None:
    """`exp` of a token that has just verified (so well-formed); None if it is not a plain number."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        exp = claims["exp"]
    except (IndexError, KeyError, ValueError, TypeError):
        return None
    if isinstance(exp, bool) or not isinstance(exp, int | float):
        return None
    return int(exp) if exp == int(exp) else None
