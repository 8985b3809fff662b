"""Enterprise federation against a real Keycloak (the server distribution from Maven Central, run by
gpuaas.devstack.keycloak on loopback with Java 21+).

Keycloak's admin REST API creates a realm, a confidential client (PKCE S256 required) and users;
the realm is registered as tenant ACME's identity provider (its domain attested by the operator:
the DNS proof is tests/security/test_federation_hardening.py). Then:
- sign-in through the platform's SSO start → Keycloak's own login form → the callback: the user is
  provisioned just in time (tenant ACME, the IdP's default role);
- a second sign-in resolves the recorded link: the same user, no duplicate;
- a Keycloak user whose email Keycloak has not verified is refused for linking (`email_not_verified`),
  even though a platform user with that email exists in the tenant;
- a user disabled in Keycloak cannot sign in (Keycloak refuses; no callback reaches the platform);
- logout ends the platform session (refresh token and access token refused);
- the console (real Chromium: web/console/tests/keycloak.e2e.mjs) and `gpuaas login --sso` (the CLI
  as a process) sign in through the same realm.

Keycloak sets its login cookies `Secure`; httpx does not send those back over http://127.0.0.1, so the
scripted browser here passes them by hand (Chromium treats loopback as secure and needs no help).
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from gpuaas.devstack.keycloak import Keycloak, KeycloakAdmin
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually

from .test_cli import Cli
from .test_console import console_served, run_browser

PASSWORD = "keycloak-user-password-1"
TIMINGS: dict[str, float] = {}


@dataclass
class Realm:
    kc: Keycloak
    admin: KeycloakAdmin
    name: str
    issuer: str
    client_id: str
    client_secret: str
    domain: str

    def user(self, local: str, *, verified: bool = True) -> tuple[str, str]:
        """A Keycloak user `local@domain`: (email, Keycloak user id)."""
        email = f"{local}@{self.domain}"
        return email, self.admin.create_user(self.name, email, email, PASSWORD, email_verified=verified)


@pytest.fixture(scope="module")
def keycloak(stack: Stack) -> Iterator[Keycloak]:
    t0 = time.monotonic()
    kc = Keycloak(stack.root / "keycloak").start()
    TIMINGS["keycloak_start_s"] = time.monotonic() - t0
    try:
        yield kc
    finally:
        kc.stop()


@pytest.fixture(scope="module")
def realm(stack: Stack, keycloak: Keycloak) -> Iterator[Realm]:
    t0 = time.monotonic()
    admin = KeycloakAdmin(keycloak.url, keycloak.admin_user, keycloak.admin_password)
    name = f"acme-{uuid.uuid4().hex[:6]}"
    admin.create_realm(name, loginWithEmailAllowed=True, duplicateEmailsAllowed=False)
    callback = f"{stack.gateway_url}/api/identity/auth/sso/callback"
    secret = admin.create_client(name, "gpuaas-platform", [callback])
    TIMINGS["realm_setup_s"] = time.monotonic() - t0
    try:
        yield Realm(
            keycloak, admin, name, f"{keycloak.url}/realms/{name}", "gpuaas-platform", secret, f"{name}.example"
        )
    finally:
        admin.close()


@dataclass
class Acme:
    tenant_id: str
    idp_id: str


@pytest.fixture(scope="module")
async def acme(stack: Stack, admin_token: str, realm: Realm) -> AsyncIterator[Acme]:
    """Tenant ACME with the realm as its IdP (module-wide: the domain can be owned once)."""
    op = {"Authorization": f"Bearer {admin_token}"}
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=op, timeout=30) as gw:
        t = await gw.post("/api/identity/tenants", json={"slug": realm.name, "name": "ACME"})
        assert t.status_code == 201, t.text
        r = await gw.post(
            f"/api/identity/tenants/{t.json()['tenant_id']}/identity-providers",
            json={
                "name": "ACME Keycloak",
                "issuer": realm.issuer,
                "client_id": realm.client_id,
                "client_secret": realm.client_secret,
                "domains": [realm.domain],
                "default_role": "viewer",
                "domains_verified": True,
            },
        )
        assert r.status_code == 201, r.text
    yield Acme(t.json()["tenant_id"], r.json()["idp_id"])


def cookies_of(response: httpx.Response, jar: dict[str, str]) -> dict[str, str]:
    """Keycloak's Set-Cookie values (Secure ones included), merged into `jar`."""
    for header in response.headers.get_list("set-cookie"):
        name, _, rest = header.partition("=")
        value = rest.split(";", 1)[0]
        if value:
            jar[name.strip()] = value
        else:
            jar.pop(name.strip(), None)
    return jar


def login_form_action(page: str) -> str:
    match = re.search(r'<form[^>]*id="kc-form-login"[^>]*action="([^"]+)"', page) or re.search(
        r'<form[^>]*action="([^"]+)"[^>]*id="kc-form-login"', page
    )
    assert match, page[:3000]
    return html.unescape(match.group(1))


async def keycloak_sign_in(start_url: str, email: str, *, callback_prefix: str) -> httpx.Response:
    """A scripted browser: the platform's start → Keycloak's form → credentials → the redirect back.
    Returns the response to the credentials POST when Keycloak does not send the browser back, else
    the platform callback's response (not followed)."""
    jar: dict[str, str] = {}
    async with httpx.AsyncClient(timeout=120) as browser:  # Keycloak is slow on a loaded machine
        start = await browser.get(start_url)
        assert start.status_code == 302, start.text
        authorize = start.headers["location"]
        query = parse_qs(urlsplit(authorize).query)
        assert query["code_challenge_method"] == ["S256"] and query["nonce"] and query["login_hint"] == [email]
        form = await browser.get(authorize)
        assert form.status_code == 200 and "kc-form-login" in form.text, form.text[:2000]
        cookies_of(form, jar)
        posted = await browser.post(
            login_form_action(form.text),
            data={"username": email, "password": PASSWORD, "credentialId": ""},
            headers={"Cookie": "; ".join(f"{k}={v}" for k, v in jar.items())},
        )
        if posted.status_code != 302:
            return posted
        back = posted.headers["location"]
        assert back.startswith(callback_prefix), back
        return await browser.get(back)


async def sso_tokens(stack: Stack, email: str) -> httpx.Response:
    start = f"{stack.gateway_url}/api/identity/auth/sso/start?email={email}"
    return await keycloak_sign_in(start, email, callback_prefix=f"{stack.gateway_url}/api/identity/auth/sso/callback?")


async def test_keycloak_federation(stack: Stack, gw: httpx.AsyncClient, realm: Realm, acme: Acme) -> None:
    t0 = time.monotonic()
    # 1. Just-in-time provisioning: a Keycloak user with a verified email of ACME's domain.
    alice, alice_kc = realm.user("alice")
    r = await sso_tokens(stack, alice)
    assert r.status_code == 200, r.text
    first = r.json()
    assert first["link_method"] == "jit" and first["access_token"] and first["refresh_token"]
    me = await gw.get("/api/identity/me", headers={"Authorization": f"Bearer {first['access_token']}"})
    assert me.status_code == 200 and me.json()["email"] == alice and me.json()["tenant_id"] == acme.tenant_id, me.text
    user_id = me.json()["user_id"]
    row = await stack.fetch(
        "identity",
        "SELECT f.subject, f.link_method, m.role FROM federated_identities f JOIN memberships m USING (user_id)"
        " WHERE f.user_id = $1 AND f.idp_id = $2",
        uuid.UUID(user_id),
        uuid.UUID(acme.idp_id),
    )
    assert [(r["subject"], r["link_method"], r["role"]) for r in row] == [(alice_kc, "jit", "viewer")]

    # 2. A second sign-in resolves the link: the same user, still one account.
    r = await sso_tokens(stack, alice)
    assert r.status_code == 200 and r.json()["link_method"] == "existing_link", r.text
    me2 = await gw.get("/api/identity/me", headers={"Authorization": f"Bearer {r.json()['access_token']}"})
    assert me2.json()["user_id"] == user_id
    assert await stack.fetchval("identity", "SELECT count(*) FROM users WHERE lower(email) = $1", alice) == 1

    # 3. An unverified email is refused for linking, although a platform user with it exists in ACME.
    bob = f"bob@{realm.domain}"
    r = await gw.post(f"/api/identity/tenants/{acme.tenant_id}/users", json={"email": bob, "password": PASSWORD})
    assert r.status_code == 201, r.text
    realm.admin.create_user(realm.name, bob, bob, PASSWORD, email_verified=False)
    r = await sso_tokens(stack, bob)
    assert r.status_code == 403 and r.json()["code"] == "email_not_verified", r.text
    links = "SELECT count(*) FROM federated_identities f JOIN users u USING (user_id) WHERE lower(u.email) = $1"
    assert await stack.fetchval("identity", links, bob) == 0

    # 4. Disabled in Keycloak: Keycloak refuses the sign-in; nothing comes back to the platform.
    realm.admin.set_enabled(realm.name, alice_kc, False)
    r = await sso_tokens(stack, alice)
    # Keycloak answers its own error page ("Account is disabled ..." or "Invalid username or password",
    # depending on its anti-enumeration setting), never a redirect back to the platform.
    assert r.status_code in (200, 400) and re.search(r"disabled|invalid", r.text, re.I), r.text[:2000]
    realm.admin.set_enabled(realm.name, alice_kc, True)

    # 5. Logout ends the platform session: the refresh token and the access token are refused.
    bearer = {"Authorization": f"Bearer {first['access_token']}"}
    r = await gw.post("/api/identity/auth/logout", data={"refresh_token": first["refresh_token"]}, headers=bearer)
    assert r.status_code in (200, 204), r.text
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as anon:
        r = await anon.post(
            "/api/identity/auth/token", data={"grant_type": "refresh_token", "refresh_token": first["refresh_token"]}
        )
        assert r.status_code in (400, 401), r.text

        async def access_refused() -> bool:
            return (await anon.get("/api/identity/me", headers=bearer)).status_code == 401

        await eventually(access_refused, 10, "the access token refused after logout")
    TIMINGS["federation_flows_s"] = time.monotonic() - t0


async def test_cli_login_through_keycloak(stack: Stack, realm: Realm, acme: Acme, tmp_path: Path) -> None:
    t0 = time.monotonic()
    carol, _ = realm.user("carol")
    cli = Cli(stack, tmp_path / "config.json")
    proc = await cli.spawn("--json", "login", "--sso", "--no-browser", "--email", carol, "--timeout", "120")
    try:
        assert proc.stderr is not None
        printed: list[str] = []
        while not any("/auth/sso/start?" in line for line in printed):
            line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
            assert line, f"the CLI printed no sign-in URL: {printed}"
            printed.append(line)
        url = next(line for line in printed if "/auth/sso/start?" in line).strip()
        return_to = parse_qs(urlsplit(url).query)["return_to"][0]
        back = await keycloak_sign_in(
            url, carol, callback_prefix=f"{stack.gateway_url}/api/identity/auth/sso/callback?"
        )
        assert back.status_code == 302 and back.headers["location"].startswith(return_to.split("?", 1)[0]), back.text
        async with httpx.AsyncClient(timeout=30) as browser:
            done = await browser.get(back.headers["location"])  # the CLI's loopback listener
        assert done.status_code == 200 and "Signed in" in done.text, done.text
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-2000:]
    result = json.loads(out)
    assert result["signed_in"] == carol and result["method"] == "sso" and result["link_method"] == "jit"
    me = await cli.json("whoami")
    assert me["email"] == carol and me["tenant_id"] == acme.tenant_id
    TIMINGS["cli_login_s"] = time.monotonic() - t0


async def test_console_login_through_keycloak(stack: Stack, gw: httpx.AsyncClient, realm: Realm, acme: Acme) -> None:
    t0 = time.monotonic()
    await console_served(stack, gw)
    dave, _ = realm.user("dave")
    erin, _ = realm.user("erin", verified=False)
    result = await run_browser(
        "keycloak.e2e.mjs",
        {
            "GATEWAY_URL": stack.gateway_url,
            "KEYCLOAK_URL": realm.kc.url,
            "SSO_EMAIL": dave,
            "SSO_PASSWORD": PASSWORD,
            "REFUSED_EMAIL": erin,
            "IDP_NAME": "ACME Keycloak",
            "SCREENSHOT_DIR": str(stack.root / "console-screenshots"),
            "SCREENSHOT_PREFIX": "keycloak-",
        },
        timeout_s=400,
    )
    assert result["landed"] == f"{stack.gateway_url}/#/allocations"
    assert "email_not_verified" in result["refusal"]
    session = result["session"]
    rows = await stack.fetch(
        "identity",
        "SELECT s.method, s.idp_id, u.email, u.tenant_id FROM sessions s JOIN users u USING (user_id)"
        " WHERE s.session_id = $1",
        uuid.UUID(session["session_id"]),
    )
    assert [(r["method"], str(r["idp_id"]), r["email"], str(r["tenant_id"])) for r in rows] == [
        ("sso", acme.idp_id, dave, acme.tenant_id)
    ]
    assert await stack.fetchval("identity", "SELECT count(*) FROM users WHERE lower(email) = $1", erin) == 0
    TIMINGS["console_login_s"] = time.monotonic() - t0
    print("KEYCLOAK_TIMINGS", json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}), flush=True)
