"""Waiting on a running stack for a progress signal (a row, a status, a count) instead of sleeping.

    host = await eventually(ready, 60, "host ready", interval_s=0.5)
    await until_done(applied_count, lambda n: n == total, stall_s=60, what="every event applied")
    await until_answered(client, f"/api/allocations/projects/{pid}/quota")  # the project reached allocations

A predicate may be a plain function or a coroutine function; what it returns when truthy is returned.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
DEFAULT_INTERVAL_S = 0.1


async def _call(fn: Callable[[], T | Awaitable[T]]) -> T:
    value = fn()
    if inspect.isawaitable(value):
        return await value
    return value


async def eventually(
    predicate: Callable[[], Any],
    timeout_s: float,
    what: str = "the condition",
    interval_s: float = DEFAULT_INTERVAL_S,
) -> Any:
    """Call `predicate` every `interval_s` until it returns something truthy, and return that; after
    `timeout_s` fail with an AssertionError naming `what` and the last value seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = None
    while loop.time() < deadline:
        last = await _call(predicate)
        if last:
            return last
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


async def until_done(
    progress: Callable[[], Any],
    done: Callable[[Any], bool],
    stall_s: float,
    what: str = "the work",
    interval_s: float = 0.5,
    timeout_s: float | None = None,
) -> Any:
    """Poll `progress` (a count, a set of states…) until `done(value)`; fail only when the value has not
    changed for `stall_s` (or, if given, after `timeout_s` in all). For waits whose length depends on
    the machine's load (fault runs) but whose progress is visible: slow is fine, stuck is not."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    value = await _call(progress)
    changed_at = start
    while not done(value):
        now = loop.time()
        if now - changed_at > stall_s:
            raise AssertionError(f"no progress for {stall_s}s waiting for {what} (stuck at: {value!r})")
        if timeout_s is not None and now - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {value!r})")
        await asyncio.sleep(interval_s)
        latest = await _call(progress)
        if latest != value:
            value, changed_at = latest, loop.time()
    return value


async def until_answered(
    client: Any,
    *urls: str,
    params: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 60,
) -> None:
    """GET each of `urls` with `client` (an httpx.AsyncClient) until every one answers 200: for a change made
    in one service to reach the projections another service authorizes with (a project, a membership, a
    tenant arrive there by event). Any answer but 200, 403 or 404 fails at once: that is not lag."""

    async def answered() -> bool:
        for url in urls:
            r = await client.get(url, params=params, headers=headers)
            assert r.status_code in (200, 403, 404), (url, r.status_code, r.text)
            if r.status_code != 200:
                return False
        return True

    await eventually(answered, timeout_s, f"{', '.join(urls)} to answer 200", interval_s=0.2)
