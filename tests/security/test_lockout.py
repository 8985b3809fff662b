"""Login throttling an attacker cannot aim at a victim, and the client address behind proxies (defect 10).

Before: behind a load balancer every login came from the balancer's address (identity took the last
X-Forwarded-For hop), so 50 failures anywhere refused everyone; five wrong passwords locked any known
account for 5 minutes, even for its owner with the right password; a service account could be locked by
anyone who knew its visible client_id. Now: per-source throttling plus a per-(account, source) backoff
(gpuaas.identity.service.throttle), and the right-most untrusted X-Forwarded-For hop as the address
(gpuaas.kit.client_address), also in sessions and audit records.

The stack's gateway trusts loopback (conftest), so the test speaks as a load balancer on loopback and
names each client's address in X-Forwarded-For.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from gpuaas.devstack.stack import Stack
from gpuaas.kit.client_address import client_address, forwarded_chain

PASSWORD = "correct horse battery staple"
TRUSTED = ["127.0.0.1", "10.0.0.0/8"]


@pytest.mark.parametrize(
    ("peer", "xff", "expected"),
    [
        ("203.0.113.7", "6.6.6.6", "203.0.113.7"),  # an untrusted peer's claim is ignored
        ("127.0.0.1", "6.6.6.6, 198.51.100.2", "198.51.100.2"),  # right-most hop, not the client's first
        ("127.0.0.1", "198.51.100.2, 10.1.2.3", "198.51.100.2"),  # trusted hops (a CIDR) are skipped
        ("127.0.0.1", "10.1.2.3", "10.1.2.3"),  # all trusted: the left-most
        ("127.0.0.1", None, "127.0.0.1"),
        ("::ffff:127.0.0.1", "192.0.2.1", "192.0.2.1"),  # IPv4-mapped peer
        ("127.0.0.1", "garbage, 192.0.2.1", "192.0.2.1"),
    ],
)
def test_client_address_is_the_right_most_untrusted_hop(peer: str, xff: str | None, expected: str) -> None:
    assert client_address(peer, xff, TRUSTED) == expected


def test_the_gateway_passes_on_no_hop_a_client_wrote() -> None:
    assert forwarded_chain("203.0.113.7", ["6.6.6.6"], TRUSTED) == ["203.0.113.7"]
    assert forwarded_chain("127.0.0.1", ["6.6.6.6, 198.51.100.2"], TRUSTED) == ["198.51.100.2", "127.0.0.1"]


async def _user(gw: httpx.AsyncClient) -> str:
    slug = f"lock-{uuid.uuid4().hex[:6]}"
    tenant_id = (await gw.post("/api/identity/tenants", json={"slug": slug, "name": "Lock"})).json()["tenant_id"]
    email = f"victim@{slug}.example.com"
    r = await gw.post(f"/api/identity/tenants/{tenant_id}/users", json={"email": email, "password": PASSWORD})
    assert r.status_code == 201, r.text
    return email


async def _login(c: httpx.AsyncClient, email: str, password: str, source: str) -> httpx.Response:
    return await c.post(
        "/api/identity/auth/token",
        data={"grant_type": "password", "username": email, "password": password},
        headers={"X-Forwarded-For": source},
    )


@pytest.mark.e2e
async def test_wrong_passwords_cannot_lock_the_owner_out(stack: Stack, gw: httpx.AsyncClient) -> None:
    email = await _user(gw)
    attacker, owner = "198.51.100.66", "192.0.2.10"
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        for _ in range(5):  # lockout_threshold (default 5)
            r = await _login(c, email, "wrong password!!", attacker)
            assert r.status_code == 401 and r.json()["code"] == "invalid_credentials", r.text
        # The attacker's address backs off from this account, even with the right password...
        r = await _login(c, email, PASSWORD, attacker)
        assert r.status_code == 429 and r.json()["code"] == "login_backoff", r.text
        assert int(r.headers["retry-after"]) > 1
        # ...the owner, elsewhere, logs in: the account was never locked (before: 423 account_locked).
        r = await _login(c, email, PASSWORD, owner)
        assert r.status_code == 200, r.text
        token = r.json()["access_token"]
        # The session records the owner's address, not the balancer's (or a hop the client wrote).
        sessions = await c.get("/api/identity/sessions", headers={"Authorization": f"Bearer {token}"})
        assert sessions.status_code == 200, sessions.text
        assert [s["client_ip"] for s in sessions.json() if s["current"]] == [owner]
        r = await _login(c, email, "wrong password!!", f"6.6.6.6, {attacker}")  # a forged first hop
        assert r.status_code == 429 and r.json()["code"] == "login_backoff", r.text


@pytest.mark.e2e
async def test_failures_behind_a_balancer_count_per_client(stack: Stack, gw: httpx.AsyncClient) -> None:
    """50 failures (source_threshold) from one client address refuse that address only."""
    email = await _user(gw)
    noisy, quiet = "198.51.100.77", "192.0.2.20"
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        for i in range(50):
            r = await _login(c, f"nobody-{i}@nowhere.example", "wrong password!!", noisy)
            assert r.status_code == 401, r.text
        r = await _login(c, email, PASSWORD, noisy)
        assert r.status_code == 429 and r.json()["code"] == "too_many_attempts", r.text
        r = await _login(c, email, PASSWORD, quiet)
        assert r.status_code == 200, r.text


@pytest.mark.e2e
async def test_a_service_account_cannot_be_locked_by_its_client_id(stack: Stack, gw: httpx.AsyncClient) -> None:
    slug = f"sa-{uuid.uuid4().hex[:6]}"
    tenant_id = (await gw.post("/api/identity/tenants", json={"slug": slug, "name": "SA"})).json()["tenant_id"]
    project_id = (await gw.post(f"/api/identity/tenants/{tenant_id}/projects", json={"name": "p"})).json()["project_id"]
    r = await gw.post(
        f"/api/identity/projects/{project_id}/service-accounts", json={"name": "ci", "scopes": ["app-controller"]}
    )
    assert r.status_code == 201, r.text
    sa = r.json()
    client_id, secret = sa["client_id"], sa["client_secret"]
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:

        async def grant(secret_: str, source: str) -> httpx.Response:
            return await c.post(
                "/api/identity/auth/token",
                data={"grant_type": "client_credentials", "client_id": client_id, "client_secret": secret_},
                headers={"X-Forwarded-For": source},
            )

        for i in range(10):  # twice the old lockout threshold, from several addresses
            r = await grant("cs_wrong", f"198.51.100.{100 + i % 3}")
            assert r.status_code == 401 and r.json()["code"] == "invalid_client", r.text
        r = await grant(secret, "192.0.2.30")
        assert r.status_code == 200, r.text  # before: 423 account_locked
        r = await grant(secret, "198.51.100.100")  # even from an address that failed (below source_threshold)
        assert r.status_code == 200, r.text
