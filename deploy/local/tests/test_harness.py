"""The test harness without a stack: waits, and operator tokens that are refreshed near expiry."""

from __future__ import annotations

import itertools

import httpx
import pytest

from gpuaas.devstack.pytest_plugin import AdminAuth, AdminTokens
from gpuaas.devstack.waiting import eventually, until_done


async def test_eventually_returns_the_first_truthy_value_of_sync_or_async_predicates() -> None:
    counter = itertools.count()
    assert await eventually(lambda: next(counter) >= 3 and "done", 5, interval_s=0.01) == "done"

    async def ready() -> dict[str, str] | None:
        return {"status": "ready"} if next(counter) > 6 else None

    assert await eventually(ready, 5, "ready", interval_s=0.01) == {"status": "ready"}


async def test_eventually_names_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match=r"waiting for the host \(last: 0\)"):
        await eventually(lambda: 0, 0.05, "the host", interval_s=0.01)


async def test_until_done_fails_only_when_progress_stalls() -> None:
    counter = itertools.count()
    # Slow but steady: no deadline, only a stall limit.
    assert await until_done(lambda: next(counter), lambda n: n >= 20, stall_s=0.5, interval_s=0.01) >= 20
    with pytest.raises(AssertionError, match="no progress"):
        await until_done(lambda: 7, lambda n: n > 7, stall_s=0.05, what="the count", interval_s=0.01)


async def test_operator_tokens_are_refreshed_near_expiry_and_only_ours_are_swapped() -> None:
    logins = itertools.count(1)
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/identity/auth/token":
            # Expires within the refresh margin: every request logs in again.
            return httpx.Response(200, json={"access_token": f"t{next(logins)}", "expires_in": 30})
        seen.append(request.headers.get("Authorization", ""))
        return httpx.Response(200, json={})

    transport = httpx.MockTransport(handler)
    tokens = AdminTokens("http://gw.test", ("admin@gpuaas.example", "pw"), transport=transport)
    first = await tokens.token(min_valid_s=0)
    assert first == "t1" and await tokens.token(min_valid_s=0) == "t1"  # still valid: no new login
    async with httpx.AsyncClient(
        base_url="http://gw.test",
        headers={"Authorization": f"Bearer {first}"},
        auth=AdminAuth(tokens),
        transport=transport,
    ) as gw:
        await gw.get("/api/allocations/hosts")
        await gw.get("/api/identity/me", headers={"Authorization": "Bearer someone-else"})
    assert seen == ["Bearer t2", "Bearer someone-else"]
