"""In-memory token buckets, one per principal (or client IP).

A bucket refills at `rate_per_s` up to `burst`. A bucket that has been idle long enough to be full
again is indistinguishable from a new one, so pruning it loses nothing; pruning runs on the request
path at most once per `prune_interval_s`. One process, one event loop: no locking needed. With
several gateway replicas each enforces its own limit (the effective limit is multiplied).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after_s: int = 0


class TokenBucketLimiter:
    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        *,
        prune_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate_per_s
        self.burst = float(max(burst, 1))
        self.prune_interval_s = prune_interval_s
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, updated_at)
        self._last_prune = clock()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str) -> Decision:
        if not self.enabled:
            return Decision(True)
        now = self._clock()
        if now - self._last_prune >= self.prune_interval_s:
            self.prune(now)
        tokens, updated = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - updated) * self.rate)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            return Decision(True)
        self._buckets[key] = (tokens, now)
        return Decision(False, retry_after_s=max(1, math.ceil((1.0 - tokens) / self.rate)))

    def prune(self, now: float | None = None) -> int:
        """Drop buckets that have refilled completely; returns how many were dropped."""
        now = self._clock() if now is None else now
        self._last_prune = now
        idle = [k for k, (tokens, at) in self._buckets.items() if tokens + (now - at) * self.rate >= self.burst]
        for key in idle:
            del self._buckets[key]
        return len(idle)
