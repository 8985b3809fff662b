"""The smaller hardening items of issue 17: the idempotency 409 under concurrent retries (defect 5), the
`return_to` API-path check (defect 11), clock-skew leeway on token times (defect 11), `/docs` assets pinned
with Subresource Integrity (defect 11), `/metrics` not public, `/auth/discover` telling only what login
needs, and tenant admins unable to raise their own project's GPU quota (the "concerns").
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid

import httpx
import pytest
from joserfc.errors import ExpiredTokenError, InvalidClaimError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import until_answered
from gpuaas.identity.domain import InvalidReturnTo, validate_return_to
from gpuaas.identity.settings import Settings
from gpuaas.kit.auth import CLOCK_SKEW_LEEWAY_S, TokenVerifier

# ------------------------------------------------------------------------------------- return_to


@pytest.mark.parametrize(
    "path", ["/api/x", "/%61pi/identity/auth/token", "/%2561pi/x", "//api/x", "/./api/x", "/c/../api/x", "/API/x"]
)
def test_return_to_refuses_api_paths_however_encoded(path: str) -> None:
    settings = Settings(public_url="https://gpu.example.com/api/identity")
    with pytest.raises(InvalidReturnTo):
        validate_return_to(settings, f"https://gpu.example.com{path}")
    assert validate_return_to(settings, "https://gpu.example.com/allocations?x=%20") == (
        "https://gpu.example.com/allocations?x=%20"
    )


# ----------------------------------------------------------------------------------- token leeway


def test_token_times_have_a_small_clock_skew_leeway() -> None:
    verifier = TokenVerifier.__new__(TokenVerifier)
    TokenVerifier.__init__(verifier, jwks=None, issuer="https://i", audience="gpuaas")
    now = int(time.time())
    base = {"iss": "https://i", "aud": "gpuaas", "sub": str(uuid.uuid4()), "exp": now + 600}
    verifier.claims.validate({**base, "nbf": now + 5, "iat": now + 5})  # minted on a clock 5 s ahead
    verifier.claims.validate({**base, "exp": now - 5})  # just expired on a clock 5 s behind
    with pytest.raises(InvalidClaimError):
        verifier.claims.validate({**base, "nbf": now + CLOCK_SKEW_LEEWAY_S + 60})
    with pytest.raises(ExpiredTokenError):
        verifier.claims.validate({**base, "exp": now - CLOCK_SKEW_LEEWAY_S - 60})


# ------------------------------------------------------------------------- through the gateway


@pytest.mark.e2e
async def test_docs_pin_swagger_ui_with_subresource_integrity(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        page = (await c.get("/docs")).text
    scripts = [line for line in page.splitlines() if "<script src=" in line or 'rel="stylesheet"' in line]
    assert len(scripts) == 2, page
    for tag in scripts:
        assert "swagger-ui-dist@5." in tag and "@5/" not in tag, tag  # one exact version, not "latest 5"
        assert 'integrity="sha384-' in tag and 'crossorigin="anonymous"' in tag, tag


@pytest.mark.e2e
async def test_metrics_are_not_served_to_proxied_callers(stack: Stack) -> None:
    """A caller through a proxy (what reaches the gateway from outside) gets 404; the scraper, a direct
    caller from the cluster's networks (here loopback), gets the metrics."""
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        r = await c.get("/metrics", headers={"X-Forwarded-For": "203.0.113.5"})
        assert r.status_code == 404 and "# TYPE" not in r.text
        r = await c.get("/metrics")
        assert r.status_code == 200 and "# TYPE" in r.text, r.text[:300]


@pytest.mark.e2e
async def test_service_metrics_are_not_routed_through_the_gateway(gw: httpx.AsyncClient) -> None:
    """Before, any signed-in user read every service's metrics at /api/<service>/metrics."""
    for service in ("identity", "allocations", "billing"):
        for path in (f"/api/{service}/metrics", f"/api/{service}/%6detrics"):
            r = await gw.get(path)
            assert r.status_code == 404 and "# TYPE" not in r.text, (path, r.status_code, r.text[:200])


@pytest.mark.e2e
async def test_discovery_tells_only_what_login_needs(stack: Stack, gw: httpx.AsyncClient) -> None:
    slug = f"disc-{uuid.uuid4().hex[:6]}"
    tenant_id = (await gw.post("/api/identity/tenants", json={"slug": slug, "name": "Secret Corp"})).json()["tenant_id"]
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        r = await c.get("/api/identity/auth/discover", params={"email": f"x@{slug}.example.com", "tenant": slug})
    assert r.status_code == 200, r.text
    body = r.text
    assert tenant_id not in body and "Secret Corp" not in body and f'"{slug}"' not in body, body
    assert r.json()["tenant_hint"] is None


async def _team_admin(gw: httpx.AsyncClient, stack: Stack) -> tuple[str, str]:
    """A tenant with one project and its tenant admin's token: (project_id, token)."""
    slug = f"q-{uuid.uuid4().hex[:6]}"
    tenant_id = (await gw.post("/api/identity/tenants", json={"slug": slug, "name": "Q"})).json()["tenant_id"]
    project_id = (await gw.post(f"/api/identity/tenants/{tenant_id}/projects", json={"name": "p"})).json()["project_id"]
    email, password = f"admin@{slug}.example.com", "a long password 1"
    r = await gw.post(
        f"/api/identity/tenants/{tenant_id}/users", json={"email": email, "password": password, "role": "tenant_admin"}
    )
    assert r.status_code == 201, r.text
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        r = await c.post(
            "/api/identity/auth/token", data={"grant_type": "password", "username": email, "password": password}
        )
    assert r.status_code == 200, r.text
    return project_id, r.json()["access_token"]


@pytest.mark.e2e
async def test_a_tenant_admin_cannot_raise_a_project_quota(stack: Stack, gw: httpx.AsyncClient) -> None:
    project_id, token = await _team_admin(gw, stack)
    url = f"/api/allocations/projects/{project_id}/quota"
    await until_answered(gw, url)  # the project reaches allocations by event
    assert (await gw.put(url, json={"max_gpus": 4})).status_code == 200  # the operator sets the cap
    auth = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30, headers=auth) as c:
        await until_answered(c, url)  # and so does the tenant admin's membership

        async def put(n: int) -> httpx.Response:
            return await c.put(url, json={"max_gpus": n})

        r = await put(64)
        assert r.status_code == 403 and r.json()["code"] == "quota_raise_forbidden", r.text
        r = await put(2)  # tightening is the tenant admin's to do
        assert r.status_code == 200 and r.json()["max_gpus"] == 2, r.text
        r = await put(3)
        assert r.status_code == 403 and r.json()["code"] == "quota_raise_forbidden", r.text
    assert (await gw.put(url, json={"max_gpus": 8})).status_code == 200  # the operator may raise it


@pytest.mark.e2e
async def test_a_concurrent_retry_in_flight_is_told_to_wait_not_that_it_was_lost(
    stack: Stack, gw: httpx.AsyncClient
) -> None:
    """Defect 5: a duplicate arriving after the first request's effect committed but before its response
    was stored was told `idempotency_request_committed` ("the response was lost when the service stopped")
    while nothing had stopped. That state is set up exactly (a reservation, committed, no response yet,
    made just now) in identity's table; the duplicate then gets 409 `idempotency_request_in_progress` with
    Retry-After. Once the reservation is stale (its process is gone), `committed` names the path to read."""
    me = (await gw.get("/api/identity/me")).json()
    principal = me["user_id"]
    body = json.dumps({"slug": f"idem-{uuid.uuid4().hex[:6]}", "name": "Idem"}).encode()
    digest = hashlib.sha256(b"POST" + b"/tenants" + b"\0" + body).hexdigest()
    key = f"inflight-{uuid.uuid4().hex}"
    engine = create_async_engine(stack.database_url("identity"))
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO idempotency_keys"
                    " (principal, key, method, path, request_hash, created_at, committed_at)"
                    " VALUES (:p, :k, 'POST', '/tenants', :h, now(), now())"
                ),
                {"p": principal, "k": key, "h": digest},
            )
        headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
        r = await gw.post("/api/identity/tenants", content=body, headers=headers)
        assert r.status_code == 409 and r.json()["code"] == "idempotency_request_in_progress", r.text
        assert r.headers["retry-after"] == "1"
        async with engine.begin() as conn:  # the process that held it died a while ago
            await conn.execute(
                text("UPDATE idempotency_keys SET created_at = now() - interval '5 minutes' WHERE key = :k"),
                {"k": key},
            )
        r = await gw.post("/api/identity/tenants", content=body, headers=headers)
        assert r.status_code == 409 and r.json()["code"] == "idempotency_request_committed", r.text
        assert r.json()["path"] == "/tenants" and r.json()["method"] == "POST"
    finally:
        await engine.dispose()
