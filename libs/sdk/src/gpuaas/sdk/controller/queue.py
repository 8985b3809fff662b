"""A rate-limited work queue of instance ids (controller-runtime's workqueue): a key is queued once however
often it is added, is not handed out while being processed (an add meanwhile queues it again when done),
can be added after a delay (timers) or with per-key exponential back-off (failures), and is handed out no
faster than `qps` overall."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import random
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Backoff:
    """`base * factor**failures`, capped, with ±`jitter` so that replicas do not retry in step."""

    base_s: float = 1.0
    factor: float = 2.0
    cap_s: float = 120.0
    jitter: float = 0.1

    def delay(self, failures: int) -> float:
        d = min(self.cap_s, self.base_s * self.factor ** max(0, failures))
        return d * (1 + random.uniform(-self.jitter, self.jitter))


class WorkQueue(Generic[K]):
    """Keys of one type `K` (the reconcile loop queues instance ids)."""

    def __init__(self, *, backoff: Backoff | None = None, qps: float = 10.0) -> None:
        self.backoff = backoff or Backoff()
        self.min_interval_s = 1.0 / qps if qps > 0 else 0.0
        self._due: list[tuple[float, int, K]] = []  # heap of (when, seq, key)
        self._when: dict[K, float] = {}  # the earliest time each queued key is due
        self._processing: set[K] = set()
        self._again: set[K] = set()  # added while processing
        self._failures: dict[K, int] = {}
        self._seq = 0
        self._last_out = 0.0
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._when)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def add(self, key: K) -> None:
        self.add_after(key, 0.0)

    def add_after(self, key: K, delay_s: float) -> None:
        """Queue `key` to be due in `delay_s` (an earlier due time wins over a later one)."""
        if key in self._processing and delay_s <= 0:
            self._again.add(key)
            return
        when = self._now() + max(0.0, delay_s)
        if key in self._when and self._when[key] <= when:
            return
        self._when[key] = when
        self._seq += 1
        heapq.heappush(self._due, (when, self._seq, key))
        self._changed.set()

    def add_rate_limited(self, key: K) -> float:
        """Requeue after a failure, with back-off growing per consecutive failure of this key."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        delay = self.backoff.delay(failures)
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """The key succeeded: its back-off starts again from the base."""
        self._failures.pop(key, None)

    def failures(self, key: K) -> int:
        return self._failures.get(key, 0)

    async def get(self) -> K:
        """The next due key (waits for one); call `done(key)` after processing it."""
        while True:
            now = self._now()
            while self._due and self._when.get(self._due[0][2]) != self._due[0][0]:
                heapq.heappop(self._due)  # superseded by an earlier add
            wait = self._due[0][0] - now if self._due else None
            if wait is not None and wait <= 0:
                pace = self._last_out + self.min_interval_s - now
                if pace > 0:
                    await asyncio.sleep(pace)
                    continue
                _, _, key = heapq.heappop(self._due)
                del self._when[key]
                self._processing.add(key)
                self._last_out = self._now()
                return key
            self._changed.clear()
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands as the event
            # fires, and this loop would then wait again (a stopped controller hung here in CI).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._changed.wait()

    def done(self, key: K) -> None:
        self._processing.discard(key)
        if key in self._again:
            self._again.discard(key)
            self.add(key)
