"""Revocation bites within seconds on every service and every open stream (defects 1 and 2).

Before: an access token stayed good on every service until it expired (~15 min) after logout, after
`DELETE /sessions/{id}`, after refresh-token reuse detection and after the account was disabled (which kept
`/me` and SSH-key writes); the allocation timeline and app instance event streams checked access only when
they connected and kept delivering after all of those and 30 s past the token's expiry.

Now (gpuaas.kit.revocation): identity events feed a deny list each service's token verification checks in
memory; streams re-check on every revocation event naming their viewer (or its project) and at the token's
expiry, then close (SSE: a last `event: access_revoked`; the terminal WebSocket: 4401/4403/4404), and the
gateway passes the close on. Through the gateway on a real stack whose identity issues 30 s tokens (so that
expiry is a scenario too): for each revocation, every service refuses the viewer's next request with
problem+json and all three streams close, each within LAG_BOUND_S (the goal is 2 s; bench/revocation.py
measures the lags).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from gpuaas.devstack.pytest_plugin import run_stack
from gpuaas.devstack.stack import Stack

from .conftest import GATEWAY_TRUSTED_PROXIES
from .revocation_probe import REVOCATIONS, STACK_ENV, STREAMS, World, build_world, run_trial, summary

pytestmark = pytest.mark.e2e
LAG_BOUND_S = 5.0  # generous for a loaded 2-core machine; the goal (≤ 2 s) is what the bench reports


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """This module's own stack: identity issues short-lived tokens here (expiry is one of the revocations)."""
    env = {**STACK_ENV, "gateway": {"GPUAAS_GATEWAY_TRUSTED_PROXIES": json.dumps(GATEWAY_TRUSTED_PROXIES)}}
    yield from run_stack(request, "gpuaas-revocation-", agents=(), env=env)


@pytest.fixture(scope="module")
async def world(stack: Stack) -> AsyncIterator[World]:
    from gpuaas.devstack.pytest_plugin import AdminAuth, AdminTokens

    tokens = AdminTokens(stack.gateway_url, stack.admin_login)
    async with httpx.AsyncClient(
        base_url=stack.gateway_url,
        headers={"Authorization": f"Bearer {await tokens.token()}"},
        auth=AdminAuth(tokens),
        timeout=30,
    ) as gw:
        w = await build_world(stack, gw)
    try:
        yield w
    finally:
        w.close()


@pytest.mark.parametrize("how", REVOCATIONS)
async def test_revocation_refuses_every_service_and_closes_every_stream(
    world: World, gw: httpx.AsyncClient, how: str
) -> None:
    trial = await run_trial(gw, world, how, deadline_s=LAG_BOUND_S + 5)
    print(f"{how}: {summary(trial)}")
    # A revoked session or an expired token is 401 everywhere. A disabled account is 401 (deny list) or, for a
    # request that passed verification just before the event landed and authorized just after, 404 (the
    # projection: no standing). A removed membership is 404: no standing in the tenant, existence hidden.
    expected = {"user_disabled": {401, 403, 404}, "membership_removed": {403, 404}}.get(how, {401})
    for service, (lag, status, code) in trial.refused.items():
        assert status in expected and not code.startswith("not problem+json"), (service, status, code)
        assert lag <= LAG_BOUND_S, (service, lag)
    missing = set(trial.refused) ^ {
        *("identity", "allocations", "app-runtime", "metering", "billing"),
        *(() if how == "membership_removed" else ("identity-me", "catalog", "allocations-write")),
    }
    assert not missing, f"still served after {how}: {missing}"
    assert set(trial.closed) == set(STREAMS), f"streams still open after {how}: {trial.closed}"
    for stream, (lag, closed_how) in trial.closed.items():
        assert lag <= LAG_BOUND_S, (stream, lag, closed_how)
        if stream == "terminal_ws":
            assert closed_how.startswith(("closed 4401", "closed 4403", "closed 4404")), closed_how
        else:
            assert closed_how == "ended after event access_revoked", closed_how


async def test_revoked_token_is_refused_when_a_stream_reconnects(world: World, gw: httpx.AsyncClient) -> None:
    """An EventSource reconnects by itself: with the revoked token, the stream is a 401 problem+json.

    The deny list reaches the allocations service through identity's events (bounded lag, not zero), so the
    browser reconnects as EventSource does until the refusal: it must come within LAG_BOUND_S, and a stream
    admitted meanwhile is closed by the revocation itself (the test above)."""
    from .revocation_probe import new_viewer, revoke

    v = await new_viewer(gw, world)
    await revoke(gw, v, "logout")
    url = f"/api/allocations/allocations/{world.allocation_id}/timeline/stream?access_token={v.access_token}"
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=world.stack.gateway_url, timeout=30) as browser:
        while True:
            async with browser.stream("GET", url, headers={"Accept": "text/event-stream"}) as r:
                if r.status_code != 200:
                    await r.aread()
                    break
            assert time.monotonic() - t0 < LAG_BOUND_S, "the revoked token still opens the stream"
            await asyncio.sleep(0.2)
    assert r.status_code == 401 and r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["code"] == "session_revoked"


async def test_service_account_secret_rotation_and_disable_revoke_its_tokens(
    world: World, gw: httpx.AsyncClient
) -> None:
    """A rotated secret takes the tokens issued with it along (before: they ran to expiry); so does disabling."""
    pid = world.project_id
    r = await gw.post(f"/api/identity/projects/{pid}/service-accounts", json={"name": "rv-ctl", "scopes": ["read"]})
    assert r.status_code == 201, r.text
    sa = r.json()
    checks = {
        "identity": f"/api/identity/projects/{pid}",
        "allocations": f"/api/allocations/projects/{pid}/allocations",
        "app-runtime": f"/api/app-runtime/instances/{world.instance_id}",
        "metering": f"/api/metering/meters?project_id={pid}",
    }

    async def token(secret: str) -> dict[str, str]:
        form = {"grant_type": "client_credentials", "client_id": sa["client_id"], "client_secret": secret}
        r = await gw.post("/api/identity/auth/token", data={**form, "scope": "read"})
        assert r.status_code == 200, r.text
        return {"Authorization": f"Bearer {r.json()['access_token']}"}

    async def statuses(auth: dict[str, str]) -> dict[str, int]:
        return {n: (await gw.get(p, headers=auth)).status_code for n, p in checks.items()}

    async def refused_everywhere(auth: dict[str, str]) -> dict[str, float]:
        t0, lags = time.monotonic(), {}
        while len(lags) < len(checks) and time.monotonic() - t0 < LAG_BOUND_S:
            for n, p in checks.items():
                if n not in lags:
                    r = await gw.get(p, headers=auth)
                    if r.status_code == 401:
                        assert r.json()["code"] == "token_revoked", r.text
                        lags[n] = time.monotonic() - t0
            await asyncio.sleep(0.05)
        return lags

    old = await token(sa["client_secret"])
    for _ in range(100):  # the service account reaching every projection
        if set((await statuses(old)).values()) == {200}:
            break
        await asyncio.sleep(0.3)
    assert set((await statuses(old)).values()) == {200}
    r = await gw.post(f"/api/identity/service-accounts/{sa['client_id']}/rotate-secret")
    assert r.status_code == 200, r.text
    lags = await refused_everywhere(old)
    print(f"secret rotated: refused after {lags}")
    assert set(lags) == set(checks), f"old token still served by {set(checks) - set(lags)}"

    await asyncio.sleep(1.0)  # iat has whole seconds: a token from the next second is after the rotation
    new = await token(r.json()["client_secret"])
    assert set((await statuses(new)).values()) == {200}
    r = await gw.post(f"/api/identity/service-accounts/{sa['client_id']}/disable")
    assert r.status_code == 200, r.text
    lags = await refused_everywhere(new)
    print(f"disabled: refused after {lags}")
    assert set(lags) == set(checks), f"disabled account's token still served by {set(checks) - set(lags)}"
