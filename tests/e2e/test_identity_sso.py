"""Enterprise SSO end to end: a second, real identity process (own schema, own broker) plays the
tenant's OIDC identity provider; the platform logs users in through the gateway with authorization
code + PKCE and links them by the brokered-linking rules.

Flows: account-type discovery (+ advisory tenant hint), JIT provisioning with the default role,
repeat login through the recorded link (no duplicate), linking an existing same-tenant user by
verified email, refusal across tenants, refusal of an unverified email, inline IdP login error,
single-use state, and `sso_required` for password logins once the tenant enforces SSO.

Completing the login at the user's surface: `return_to` (the console, or the CLI's loopback listener;
anything else refused, never an open redirect), the 302 back with a single-use login code (never the
tokens), its exchange at `POST /auth/token` exactly once, errors handed back as `error=<code>`; the
code bound to the client that started the login (RFC 7636 S256: a start with return_to needs a
code_challenge, the exchange its code_verifier; a wrong or missing one spends the code); the console
signing in through SSO in a real Chromium, and `gpuaas login --sso` as a process.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from authlib.oauth2.rfc7636 import create_s256_code_challenge

from gpuaas.devstack.infra import Tansu, free_port, stop_process
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually
from gpuaas.kit.event_signing import generate_seed
from gpuaas.kit.provision import ensure_service_schema
from gpuaas.kit.secrets_at_rest import generate_key_text

from .test_cli import Cli
from .test_console import console_served, run_browser

PASSWORD = "enterprise-password-1"
KEY_VARIABLES = ("GPUAAS_SECRETS_KEYS", "GPUAAS_IDENTITY_EVENT_SIGNING_KEY", "GPUAAS_EVENT_VERIFY_KEYS")


@dataclass
class EnterpriseIdP:
    url: str
    admin: dict[str, str]
    client_id: str
    client_secret: str
    tenant_id: str

    async def user(self, email: str, *, verified: bool = True) -> None:
        async with httpx.AsyncClient(base_url=self.url, headers=self.admin, timeout=30) as c:
            r = await c.post(
                f"/tenants/{self.tenant_id}/users",
                json={"email": email, "password": PASSWORD, "role": "viewer", "email_verified": verified},
            )
            assert r.status_code == 201, r.text


@pytest.fixture(scope="module")
async def idp(stack: Stack) -> AsyncIterator[EnterpriseIdP]:
    """`python -m gpuaas.identity` again, as the enterprise IdP: own schema, own Tansu, own port."""
    root = stack.root / "enterprise-idp"
    root.mkdir(exist_ok=True)
    broker = Tansu(port=free_port(), log_path=root / "tansu.log")
    broker.start()
    schema = f"idp_{uuid.uuid4().hex[:6]}"
    db_url = await ensure_service_schema(stack.database_admin_url, schema, secrets.token_urlsafe(12))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    admin_email, admin_password = "it@acme-idp.test", "idp-admin-password"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GPUAAS_")},
        "GPUAAS_IDENTITY_DATABASE_URL": db_url,
        "GPUAAS_IDENTITY_DB_SCHEMA": schema,
        "GPUAAS_IDENTITY_PORT": str(port),
        "GPUAAS_IDENTITY_PUBLIC_URL": url,
        "GPUAAS_IDENTITY_BOOTSTRAP_ADMIN_EMAIL": admin_email,
        "GPUAAS_IDENTITY_BOOTSTRAP_ADMIN_PASSWORD": admin_password,
        "GPUAAS_IDENTITY_LOG_JSON": "false",
        # Its own keys (issue 17): no default keyring, and identity's events are signed.
        "GPUAAS_SECRETS_KEYS": generate_key_text("idp"),
        "GPUAAS_IDENTITY_EVENT_SIGNING_KEY": generate_seed(),
        "GPUAAS_KAFKA_BOOTSTRAP": broker.bootstrap,
        "GPUAAS_JWKS_URL": f"{url}/.well-known/jwks.json",
        "GPUAAS_JWT_ISSUER": url,
        # The key material the stack's identity has (event signing, secrets at rest); nothing else is shared.
        **{k: v for k, v in stack.env_for("identity").items() if k in KEY_VARIABLES},
    }
    try:
        proc, log = await asyncio.to_thread(_launch, env, root)
    except BaseException:
        broker.stop()
        raise
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            for _ in range(300):
                try:
                    if (await c.get("/readyz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None, (root / "identity-idp.log").read_text()[-3000:]
                await asyncio.sleep(0.2)
            r = await c.post(
                "/auth/token", data={"grant_type": "password", "username": admin_email, "password": admin_password}
            )
            admin = {"Authorization": f"Bearer {r.json()['access_token']}"}
            t = await c.post("/tenants", json={"slug": "acme-corp", "name": "ACME (IdP side)"}, headers=admin)
            assert t.status_code == 201, t.text
            callback = f"{stack.gateway_url}/api/identity/auth/sso/callback"
            cl = await c.post("/oauth-clients", json={"name": "gpuaas", "redirect_uris": [callback]}, headers=admin)
            assert cl.status_code == 201, cl.text
        yield EnterpriseIdP(url, admin, cl.json()["client_id"], cl.json()["client_secret"], t.json()["tenant_id"])
    finally:
        stop_process(proc)
        log.close()
        broker.stop()


def _launch(env: dict[str, str], root: Path) -> tuple[subprocess.Popen, IO[bytes]]:
    subprocess.run([sys.executable, "-m", "gpuaas.identity", "migrate"], env=env, check=True, timeout=120)
    log = open(root / "identity-idp.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuaas.identity", "serve"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, log


@dataclass
class Acme:
    tenant_id: str
    idp_id: str
    domain: str


async def acme_tenant(gw: httpx.AsyncClient, idp: EnterpriseIdP, *, name: str = "ACME Entra") -> Acme:
    """A platform tenant owning a fresh email domain through the enterprise IdP (default role viewer)."""
    suffix = uuid.uuid4().hex[:6]
    domain = f"acme{suffix}.example.com"
    t = await gw.post("/api/identity/tenants", json={"slug": f"acme-{suffix}", "name": "ACME"})
    assert t.status_code == 201, t.text
    r = await gw.post(
        f"/api/identity/tenants/{t.json()['tenant_id']}/identity-providers",
        json={
            "name": name,
            "issuer": idp.url,
            "client_id": idp.client_id,
            "client_secret": idp.client_secret,
            "domains": [domain],
            "default_role": "viewer",
            "domains_verified": True,  # the operator attests (DNS proof: tests/security/test_federation_hardening.py)
        },
    )
    assert r.status_code == 201, r.text
    return Acme(t.json()["tenant_id"], r.json()["idp_id"], domain)


def hidden_fields(page: str) -> dict[str, str]:
    return dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', page))


def pkce(verifier: str) -> dict[str, str]:
    """The start parameters binding the login code to the holder of `verifier` (RFC 7636 S256)."""
    return {"code_challenge": create_s256_code_challenge(verifier), "code_challenge_method": "S256"}


async def sso_login(
    gateway: str,
    email: str,
    password: str = PASSWORD,
    *,
    return_to: str | None = None,
    code_verifier: str | None = None,
) -> httpx.Response:
    """What a browser does: start at the gateway (with return_to, the client's S256 challenge of
    `code_verifier`), sign in at the IdP's form, come back to the callback (whose answer is returned,
    not followed)."""
    params = {"email": email}
    if return_to:
        params.update(return_to=return_to, **pkce(code_verifier or secrets.token_urlsafe(32)))
    async with httpx.AsyncClient(timeout=30) as browser:
        start = await browser.get(f"{gateway}/api/identity/auth/sso/start", params=params)
        assert start.status_code == 302, start.text
        authorize_url = start.headers["location"]
        query = {k: v[0] for k, v in parse_qs(urlsplit(authorize_url).query).items()}
        assert query["code_challenge_method"] == "S256" and query["code_challenge"] and query["nonce"]
        form = await browser.get(authorize_url)
        assert form.status_code == 200 and "<form" in form.text
        fields = hidden_fields(form.text)
        base = authorize_url.split("?", 1)[0]
        submitted = await browser.post(base, data={**fields, "email": email, "password": password})
        if submitted.status_code != 303:
            return submitted  # the IdP's own inline error
        back = submitted.headers["location"]
        assert back.startswith(f"{gateway}/api/identity/auth/sso/callback?")
        result = await browser.get(back)
        result.extensions["callback_url"] = back
        return result


async def test_enterprise_sso_federation(stack: Stack, gw: httpx.AsyncClient, idp: EnterpriseIdP) -> None:
    # The platform side: tenant ACME owns the domain through its IdP; tenant Other exists too.
    acme = await acme_tenant(gw, idp)
    tid, idp_id, domain = acme.tenant_id, acme.idp_id, acme.domain
    suffix = uuid.uuid4().hex[:6]
    other = await gw.post("/api/identity/tenants", json={"slug": f"other-{suffix}", "name": "Other"})
    assert other.status_code == 201
    other_tid = other.json()["tenant_id"]
    r = await gw.post(
        f"/api/identity/tenants/{other_tid}/identity-providers",
        json={"name": "dup", "issuer": idp.url, "client_id": "x", "domains": [domain]},
    )
    assert r.status_code == 409 and r.json()["code"] == "domain_taken"

    # Account-type discovery (public): only what login needs, never the tenant; the hint is ignored.
    r = await gw.get("/api/identity/auth/discover", params={"email": f"alice@{domain}", "tenant": f"other-{suffix}"})
    d = r.json()
    assert d["account_type"] == "work" and d["login"] == "sso" and d["tenant"] is None
    assert d["identity_provider"]["idp_id"] == idp_id and d["tenant_hint"] is None
    d = (await gw.get("/api/identity/auth/discover", params={"email": "someone@gmail.com"})).json()
    assert d["account_type"] == "personal" and d["login"] == "password" and d["tenant"] is None

    # 1. JIT: first login of alice creates her in ACME with the default role.
    await idp.user(f"alice@{domain}")
    r = await sso_login(stack.gateway_url, f"alice@{domain}")
    assert r.status_code == 200, r.text
    alice = r.json()
    assert alice["link_method"] == "jit" and alice["refresh_token"]
    me = (await gw.get("/api/identity/me", headers={"Authorization": f"Bearer {alice['access_token']}"})).json()
    assert me["tenant_id"] == tid and [(m["scope"], m["role"]) for m in me["memberships"]] == [("tenant", "viewer")]
    # The callback's state is single use.
    async with httpx.AsyncClient(timeout=30) as c:
        replay = await c.get(r.extensions["callback_url"])
    assert replay.status_code == 400 and replay.json()["code"] == "sso_state_invalid"

    # 2. Again: through the recorded link, never a duplicate user.
    r = await sso_login(stack.gateway_url, f"alice@{domain}")
    assert r.status_code == 200 and r.json()["link_method"] == "existing_link"
    assert (
        await stack.fetchval("identity", "SELECT count(*) FROM users WHERE lower(email) = $1", f"alice@{domain}") == 1
    )

    # 3. An existing ACME user (password account) is linked by verified email, keeping her user id.
    r = await gw.post(
        f"/api/identity/tenants/{tid}/users",
        json={"email": f"bob@{domain}", "password": "bob-local-password", "role": "project_member"},
    )
    bob_id = r.json()["user_id"]
    await idp.user(f"bob@{domain}")
    r = await sso_login(stack.gateway_url, f"bob@{domain}")
    assert r.status_code == 200 and r.json()["link_method"] == "verified_email", r.text
    me = (await gw.get("/api/identity/me", headers={"Authorization": f"Bearer {r.json()['access_token']}"})).json()
    assert me["user_id"] == bob_id

    # 4. Same email, but the existing account belongs to another tenant: never linked across tenants.
    await gw.post(
        f"/api/identity/tenants/{other_tid}/users",
        json={"email": f"carol@{domain}", "password": "carol-local-password", "role": None},
    )
    await idp.user(f"carol@{domain}")
    r = await sso_login(stack.gateway_url, f"carol@{domain}")
    assert r.status_code == 403 and r.json()["code"] == "account_link_refused"

    # 5. The IdP did not verify the email: refused, nothing created.
    await idp.user(f"mallory@{domain}", verified=False)
    r = await sso_login(stack.gateway_url, f"mallory@{domain}")
    assert r.status_code == 403 and r.json()["code"] == "email_not_verified"
    assert await stack.fetchval("identity", "SELECT count(*) FROM users WHERE email = $1", f"mallory@{domain}") == 0

    # 6. Wrong password at the IdP: its form answers inline with a stable code.
    r = await sso_login(stack.gateway_url, f"alice@{domain}", password="wrong-password")
    assert r.status_code == 401 and 'data-code="invalid_credentials"' in r.text

    # Links and refusals are recorded.
    links = await stack.fetch(
        "identity", "SELECT email, link_method FROM federated_identities WHERE idp_id = $1", uuid.UUID(idp_id)
    )
    assert sorted((x["email"], x["link_method"]) for x in links) == [
        (f"alice@{domain}", "jit"),
        (f"bob@{domain}", "verified_email"),
    ]

    async def audited() -> bool:
        rows = (
            await gw.get("/api/identity/audit", params={"tenant_id": tid, "action": "identity.federation.link"})
        ).json()["items"]
        return {"succeeded", "denied"} <= {x["outcome"] for x in rows}

    await eventually(audited, 30, "federation audit records")

    # 7. Once the tenant enforces SSO, bob's local password no longer works: inline `sso_required`.
    await stack.execute(
        "identity", "UPDATE identity_providers SET enforce_sso = true WHERE idp_id = $1", uuid.UUID(idp_id)
    )
    r = await gw.post(
        "/api/identity/auth/token",
        data={"grant_type": "password", "username": f"bob@{domain}", "password": "bob-local-password"},
    )
    assert r.status_code == 403 and r.json()["code"] == "sso_required" and r.json()["idp_id"] == idp_id


async def test_sso_return_to_login_code(stack: Stack, gw: httpx.AsyncClient, idp: EnterpriseIdP) -> None:
    acme = await acme_tenant(gw, idp)
    start = f"{stack.gateway_url}/api/identity/auth/sso/start"
    email = f"dora@{acme.domain}"
    async with httpx.AsyncClient(timeout=30) as c:
        # Never an open redirect: other hosts, look-alikes, userinfo tricks, schemes, API paths, a loopback
        # without its port are refused before anything is stored, with a stable code.
        refused = [
            "https://evil.example/",
            "//evil.example/console",
            "http://127.0.0.1.evil.example:8000/",
            f"{stack.gateway_url}@evil.example/",
            "http://127.0.0.1/cb",
            "javascript:alert(1)",
            f"{stack.gateway_url}/api/identity/me",
            "/\\evil.example",
        ]
        for bad in refused:
            r = await c.get(start, params={"email": email, "return_to": bad})
            assert r.status_code == 400, (bad, r.status_code, r.text)
            assert r.headers["content-type"].startswith("application/problem+json")
            assert r.json()["code"] == "invalid_return_to", bad
        stored = "SELECT count(*) FROM sso_states WHERE return_to = ANY($1::text[])"
        assert await stack.fetchval("identity", stored, refused) == 0
        # The console and a loopback listener are fine, with the client's S256 challenge; without one (or
        # with another method) they are refused too: the login code is always bound to its client.
        verifier = secrets.token_urlsafe(32)
        goods = [f"{stack.gateway_url}/", "/?from=path", "http://127.0.0.1:45123/callback?cli_state=x"]
        for good in goods:
            r = await c.get(start, params={"email": email, "return_to": good})
            assert r.status_code == 400 and r.json()["code"] == "code_challenge_required", (good, r.text)
            plain = {"code_challenge": verifier, "code_challenge_method": "plain"}
            r = await c.get(start, params={"email": email, "return_to": good, **plain})
            assert r.status_code == 400 and r.json()["code"] == "invalid_code_challenge", (good, r.text)
        with_return_to = "SELECT count(*) FROM sso_states WHERE idp_id = $1 AND return_to IS NOT NULL"
        assert await stack.fetchval("identity", with_return_to, uuid.UUID(acme.idp_id)) == 0
        for good in goods:
            r = await c.get(start, params={"email": email, "return_to": good, **pkce(verifier)})
            assert r.status_code == 302 and r.headers["location"].startswith(f"{idp.url}/oauth/authorize?"), good
        challenges = "SELECT client_code_challenge FROM sso_states WHERE idp_id = $1 AND return_to IS NOT NULL"
        rows = await stack.fetch("identity", challenges, uuid.UUID(acme.idp_id))
        assert [r["client_code_challenge"] for r in rows] == [create_s256_code_challenge(verifier)] * len(goods)

    # A login with return_to comes back there with a single-use code, not the tokens.
    await idp.user(email)
    console = f"{stack.gateway_url}/?sso=n0nce"
    verifier = secrets.token_urlsafe(48)
    r = await sso_login(stack.gateway_url, email, return_to=console, code_verifier=verifier)
    assert r.status_code == 302, r.text
    callback_url, back = r.extensions["callback_url"], r.headers["location"]
    assert back.startswith(f"{console}&login_code=slc_"), back
    assert "access_token" not in back and "refresh_token" not in back
    code = parse_qs(urlsplit(back).query)["login_code"][0]
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        exchange = {"grant_type": "sso_login_code", "code": code, "code_verifier": verifier}
        r = await c.post("/api/identity/auth/token", data=exchange)
        assert r.status_code == 200, r.text
        tokens = r.json()
        assert tokens["link_method"] == "jit" and tokens["refresh_token"] and tokens["session_id"]
        me = await c.get("/api/identity/me", headers={"Authorization": f"Bearer {tokens['access_token']}"})
        assert me.status_code == 200 and me.json()["email"] == email and me.json()["tenant_id"] == acme.tenant_id
        # Exactly once: a replay (or an unknown code) is invalid_grant, and opens no second session.
        for attempt in (code, "slc_unknown"):
            r = await c.post("/api/identity/auth/token", data={**exchange, "code": attempt})
            assert r.status_code == 400 and r.json()["code"] == "invalid_grant", r.text
        sessions = (
            "SELECT count(*) FROM sessions s JOIN users u USING (user_id) WHERE u.email = $1 AND s.method = 'sso'"
        )
        assert await stack.fetchval("identity", sessions, email) == 1
        # The spent state, replayed, goes back to the console with an error instead of signing in again.
        r = await c.get(callback_url)
        assert r.status_code == 302, r.text
        query = parse_qs(urlsplit(r.headers["location"]).query)
        assert query["error"] == ["sso_state_invalid"] and "login_code" not in query

    # Someone who saw the redirect URL (history, a log, a referrer) holds the code but not the verifier: a
    # wrong or missing verifier is invalid_grant AND spends the code, so the right verifier afterwards
    # fails too; no session is opened, and the refusal is audited.
    for wrong in ({"code_verifier": secrets.token_urlsafe(48)}, {}):
        verifier = secrets.token_urlsafe(48)
        r = await sso_login(stack.gateway_url, email, return_to=console, code_verifier=verifier)
        assert r.status_code == 302, r.text
        code = parse_qs(urlsplit(r.headers["location"]).query)["login_code"][0]
        bound = "SELECT code_challenge FROM sso_login_codes WHERE idp_id = $1 AND used_at IS NULL"
        assert await stack.fetchval("identity", bound, uuid.UUID(acme.idp_id)) == create_s256_code_challenge(verifier)
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
            r = await c.post("/api/identity/auth/token", data={"grant_type": "sso_login_code", "code": code, **wrong})
            assert r.status_code == 400 and r.json()["code"] == "invalid_grant", r.text
            assert "access_token" not in r.json()
            right = {"grant_type": "sso_login_code", "code": code, "code_verifier": verifier}
            r = await c.post("/api/identity/auth/token", data=right)
            assert r.status_code == 400 and r.json()["code"] == "invalid_grant", r.text
        assert await stack.fetchval("identity", bound, uuid.UUID(acme.idp_id)) is None  # spent
        assert await stack.fetchval("identity", sessions, email) == 1  # still only the first login's

    async def refusals_audited() -> bool:
        rows = (
            await gw.get(
                "/api/identity/audit",
                params={"tenant_id": acme.tenant_id, "action": "identity.session.create"},
            )
        ).json()["items"]
        reasons = {x["reason"] for x in rows if x["outcome"] == "denied"}
        return {"code_verifier_mismatch", "code_verifier_missing"} <= reasons

    await eventually(refusals_audited, 30, "the refused exchanges' audit records")

    # A refusal (the IdP did not verify the email) goes back as error=<code>, never with a code.
    mallory = f"mallory@{acme.domain}"
    await idp.user(mallory, verified=False)
    r = await sso_login(stack.gateway_url, mallory, return_to=console)
    assert r.status_code == 302, r.text
    query = parse_qs(urlsplit(r.headers["location"]).query)
    assert query["error"] == ["email_not_verified"] and query["sso"] == ["n0nce"] and "login_code" not in query
    assert query["error_description"][0]


async def test_cli_login_sso(stack: Stack, gw: httpx.AsyncClient, idp: EnterpriseIdP, tmp_path: Path) -> None:
    """`gpuaas login --sso` as a process: it prints the sign-in URL and listens on a loopback port; httpx
    plays the browser (start → IdP form → callback → the CLI's listener), then the CLI has a session."""
    acme = await acme_tenant(gw, idp)
    email = f"erin@{acme.domain}"
    await idp.user(email)
    cli = Cli(stack, tmp_path / "config.json")
    argv = ["--json", "login", "--sso", "--no-browser", "--email", email, "--timeout", "120"]
    proc = await cli.spawn(*argv)
    try:
        assert proc.stderr is not None
        printed: list[str] = []
        while not any("/auth/sso/start?" in line for line in printed):
            line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
            assert line, f"the CLI printed no sign-in URL: {printed}"
            printed.append(line)
        url = next(line for line in printed if "/auth/sso/start?" in line).strip()
        assert url.startswith(f"{stack.gateway_url}/api/identity/auth/sso/start?")
        started = parse_qs(urlsplit(url).query)
        return_to = started["return_to"][0]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/callback\?cli_state=[\w-]+", return_to), return_to
        # Bound to the CLI process: the S256 challenge is in the URL, the verifier only in the process.
        assert started["code_challenge_method"] == ["S256"], started
        assert re.fullmatch(r"[\w-]{43}", started["code_challenge"][0]), started
        async with httpx.AsyncClient(timeout=30, follow_redirects=True) as browser:
            form = await browser.get(url)  # the gateway redirects to the IdP's login form
            assert form.status_code == 200 and str(form.url).startswith(f"{idp.url}/oauth/authorize"), form.text
            done = await browser.post(
                str(form.url).split("?", 1)[0], data={**hidden_fields(form.text), "email": email, "password": PASSWORD}
            )
        # IdP 303 → gateway callback 302 → the CLI's loopback listener, which says so.
        assert done.status_code == 200 and "Signed in" in done.text, done.text
        assert str(done.url).startswith(return_to.split("?", 1)[0]) and "login_code=slc_" in str(done.url)
        hops = [str(h.url) for h in done.history]
        assert any("/auth/sso/callback?" in h for h in hops), hops
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()[-2000:]
    result = json.loads(out)
    assert result["signed_in"] == email and result["method"] == "sso" and result["link_method"] == "jit"
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["refresh_token"] and config["email"] == email
    assert (tmp_path / "config.json").stat().st_mode & 0o077 == 0
    me = await cli.json("whoami")
    assert me["email"] == email and me["tenant_id"] == acme.tenant_id
    # The code it used is spent; a personal-domain email has no SSO: a clear problem, exit 1.
    rc, _, err_text = await cli("login", "--sso", "--no-browser", "--email", "someone@gmail.com", ok=False)
    assert rc == 1 and "sso_not_configured" in err_text and "Traceback" not in err_text
    used = (
        "SELECT c.code_challenge FROM sso_login_codes c JOIN users u USING (user_id)"
        " WHERE u.email = $1 AND used_at IS NOT NULL"
    )
    assert [r["code_challenge"] for r in await stack.fetch("identity", used, email)] == started["code_challenge"]


async def test_console_sso_login(stack: Stack, gw: httpx.AsyncClient, idp: EnterpriseIdP) -> None:
    """The console's Work account tab through the enterprise IdP in a real Chromium (web/console/tests/sso.e2e.mjs)."""
    await console_served(stack, gw)
    acme = await acme_tenant(gw, idp, name="ACME Okta")
    email, refused = f"fay@{acme.domain}", f"gil@{acme.domain}"
    await idp.user(email)
    await idp.user(refused, verified=False)
    result = await run_browser(
        "sso.e2e.mjs",
        {
            "GATEWAY_URL": stack.gateway_url,
            "SSO_EMAIL": email,
            "SSO_PASSWORD": PASSWORD,
            "REFUSED_EMAIL": refused,
            "IDP_NAME": "ACME Okta",
            "SCREENSHOT_DIR": str(stack.root / "console-screenshots"),
            "SCREENSHOT_PREFIX": "sso-",
        },
        timeout_s=300,
    )
    assert result["landed"] == f"{stack.gateway_url}/#/allocations"
    assert result["pkce"]["challenge_method"] == "S256" and result["pkce"]["verifier_length"] >= 43
    assert "email_not_verified" in result["refusal"]
    assert len(result["screenshots"]) >= 5
    # The browser's session is a real SSO session of the JIT-provisioned user, through this IdP.
    session = result["session"]
    rows = await stack.fetch(
        "identity",
        "SELECT s.method, s.idp_id, u.email, u.tenant_id FROM sessions s JOIN users u USING (user_id)"
        " WHERE s.session_id = $1",
        uuid.UUID(session["session_id"]),
    )
    assert len(rows) == 1 and rows[0]["method"] == "sso" and rows[0]["email"] == email
    row = rows[0]
    assert str(row["idp_id"]) == acme.idp_id and str(row["tenant_id"]) == acme.tenant_id
    assert await stack.fetchval("identity", "SELECT count(*) FROM users WHERE email = $1", refused) == 0
