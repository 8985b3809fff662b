"""Enterprise SSO end to end: a second, real identity process (own schema, own broker) plays the
tenant's OIDC identity provider; the platform logs users in through the gateway with authorization
code + PKCE and links them by the brokered-linking rules.

Flows: account-type discovery (+ advisory tenant hint), JIT provisioning with the default role,
repeat login through the recorded link (no duplicate), linking an existing same-tenant user by
verified email, refusal across tenants, refusal of an unverified email, inline IdP login error,
single-use state, and `sso_required` for password logins once the tenant enforces SSO.
"""

from __future__ import annotations

import asyncio
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

from gpuaas.devstack.infra import Tansu, free_port, stop_process
from gpuaas.devstack.stack import Stack
from gpuaas.kit.provision import ensure_service_schema

from .conftest import eventually

PASSWORD = "enterprise-password-1"


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
        "GPUAAS_KAFKA_BOOTSTRAP": broker.bootstrap,
        "GPUAAS_JWKS_URL": f"{url}/.well-known/jwks.json",
        "GPUAAS_JWT_ISSUER": url,
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


async def sso_login(gateway: str, email: str, password: str = PASSWORD) -> httpx.Response:
    """What a browser does: start at the gateway, sign in at the IdP's form, come back to the callback."""
    async with httpx.AsyncClient(timeout=30) as browser:
        start = await browser.get(f"{gateway}/api/identity/auth/sso/start", params={"email": email})
        assert start.status_code == 302, start.text
        authorize_url = start.headers["location"]
        query = {k: v[0] for k, v in parse_qs(urlsplit(authorize_url).query).items()}
        assert query["code_challenge_method"] == "S256" and query["code_challenge"] and query["nonce"]
        form = await browser.get(authorize_url)
        assert form.status_code == 200 and "<form" in form.text
        fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', form.text))
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
    suffix = uuid.uuid4().hex[:6]
    domain = f"acme{suffix}.example.com"
    # The platform side: tenant ACME owns the domain through its IdP; tenant Other exists too.
    t = await gw.post("/api/identity/tenants", json={"slug": f"acme-{suffix}", "name": "ACME"})
    other = await gw.post("/api/identity/tenants", json={"slug": f"other-{suffix}", "name": "Other"})
    assert t.status_code == other.status_code == 201
    tid, other_tid = t.json()["tenant_id"], other.json()["tenant_id"]
    r = await gw.post(
        f"/api/identity/tenants/{tid}/identity-providers",
        json={
            "name": "ACME Entra",
            "issuer": idp.url,
            "client_id": idp.client_id,
            "client_secret": idp.client_secret,
            "domains": [domain],
            "default_role": "viewer",
        },
    )
    assert r.status_code == 201, r.text
    idp_id = r.json()["idp_id"]
    r = await gw.post(
        f"/api/identity/tenants/{other_tid}/identity-providers",
        json={"name": "dup", "issuer": idp.url, "client_id": "x", "domains": [domain]},
    )
    assert r.status_code == 409 and r.json()["code"] == "domain_taken"

    # Account-type discovery (public), hint advisory.
    r = await gw.get("/api/identity/auth/discover", params={"email": f"alice@{domain}", "tenant": f"other-{suffix}"})
    d = r.json()
    assert d["account_type"] == "work" and d["login"] == "sso" and d["tenant"]["tenant_id"] == tid
    assert d["identity_provider"]["idp_id"] == idp_id and d["tenant_hint"] == {
        "slug": f"other-{suffix}",
        "matches": False,
    }
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
