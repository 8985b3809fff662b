"""Issue 17, defects 6 and 7: email domains are owned by proof, not first come first served; emails are
verified by something real; identity's relying parties get only their tenant's users, the scopes
they asked for, and verified emails.

identity runs in process (real Postgres, real broker) with the test's DNS server (dnspython over UDP
on loopback) as the operator's resolver: ownership is proven by a real TXT lookup.
"""

from __future__ import annotations

import base64
import json
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from authlib.oauth2.rfc7636 import create_s256_code_challenge

from .federation_support import PASSWORD, IdentityUnderTest, LoopbackDns, identity_app


@dataclass
class World:
    identity: IdentityUnderTest
    dns: LoopbackDns


@pytest.fixture(scope="module")
async def world(infra) -> AsyncIterator[World]:
    dns = LoopbackDns().start()
    try:
        async with identity_app(infra.admin_url, infra.kafka_bootstrap, dns_nameservers=[dns.nameserver]) as identity:
            yield World(identity, dns)
    finally:
        dns.stop()


async def register_idp(w: World, t: dict[str, Any], domain: str, **extra: Any) -> Any:
    headers = extra.pop("headers", None) or t["admin"]
    return await w.identity.client.post(
        f"/tenants/{t['tenant_id']}/identity-providers",
        json={"name": "idp", "issuer": "https://idp.example.com", "client_id": "c", "domains": [domain], **extra},
        headers=headers,
    )


async def verify(w: World, t: dict[str, Any], idp_id: str, domain: str) -> Any:
    return await w.identity.client.post(
        f"/tenants/{t['tenant_id']}/identity-providers/{idp_id}/domains/{domain}/verify", headers=t["admin"]
    )


async def discover(w: World, email: str) -> dict[str, Any]:
    r = await w.identity.client.get("/auth/discover", params={"email": email})
    assert r.status_code == 200, r.text
    return dict(r.json())


async def add_user(w: World, t: dict[str, Any], email: str, **extra: Any) -> Any:
    return await w.identity.client.post(
        f"/tenants/{t['tenant_id']}/users", json={"email": email, "password": PASSWORD, **extra}, headers=t["admin"]
    )


async def test_a_claimed_domain_does_nothing_until_proven_and_the_owner_wins(world: World) -> None:
    w = world
    domain = f"victim-{uuid.uuid4().hex[:6]}.example"
    attacker, owner = await w.identity.tenant(), await w.identity.tenant()

    # The attacker claims the victim's domain with enforced SSO: nothing changes for anyone.
    r = await register_idp(w, attacker, domain, enforce_sso=True)
    assert r.status_code == 201, r.text
    bad_idp = r.json()["idp_id"]
    claim = r.json()["domain_claims"][0]
    assert claim["verified"] is False and claim["challenge_name"] == f"_gpuaas-challenge.{domain}"
    assert (await discover(w, f"ceo@{domain}"))["account_type"] == "personal"
    r = await verify(w, attacker, bad_idp, domain)  # no TXT record: not proven
    assert r.status_code == 409 and r.json()["code"] == "domain_not_proven", r.text

    # The real owner registers the same domain (no `domain_taken`), publishes its own token, proves it.
    r = await register_idp(w, owner, domain, enforce_sso=True)
    assert r.status_code == 201, r.text
    good_idp, token = r.json()["idp_id"], r.json()["domain_claims"][0]["challenge_value"]
    assert token != claim["challenge_value"]  # one token per claim: a record proves one claim only
    # The attacker's token in the owner's DNS proves nothing for the owner, and vice versa.
    w.dns.set(f"_gpuaas-challenge.{domain}", "TXT", claim["challenge_value"])
    r = await verify(w, owner, good_idp, domain)
    assert r.status_code == 409 and r.json()["code"] == "domain_not_proven", r.text
    w.dns.set(f"_gpuaas-challenge.{domain}", "TXT", "v=spf1 -all", token)
    r = await verify(w, owner, good_idp, domain)
    assert r.status_code == 200 and r.json()["verified"] is True, r.text
    assert (f"_gpuaas-challenge.{domain}", "TXT") in w.dns.queries

    d = await discover(w, f"ceo@{domain}")
    assert d["account_type"] == "work" and d["identity_provider"]["idp_id"] == good_idp
    # The attacker's claim is gone; claiming again is `domain_taken`; the operator cannot attest it over
    # the owner either.
    r = await verify(w, attacker, bad_idp, domain)
    assert r.status_code == 404 and r.json()["code"] == "domain_claim_not_found", r.text
    r = await register_idp(w, attacker, domain)
    assert r.status_code == 409 and r.json()["code"] == "domain_taken", r.text
    r = await register_idp(w, attacker, domain, domains_verified=True, headers=attacker["op"])
    assert r.status_code == 409 and r.json()["code"] == "domain_taken", r.text


async def test_enforced_sso_needs_a_proven_domain(world: World) -> None:
    w = world
    t = await w.identity.tenant()
    domain = f"corp-{uuid.uuid4().hex[:6]}.example"
    email = f"dev@{domain}"
    assert (await add_user(w, t, email)).status_code == 201
    r = await register_idp(w, t, domain, enforce_sso=True)
    idp_id, token = r.json()["idp_id"], r.json()["domain_claims"][0]["challenge_value"]
    login = {"grant_type": "password", "username": email, "password": PASSWORD}
    assert (await w.identity.client.post("/auth/token", data=login)).status_code == 200  # unproven: no effect
    w.dns.set(f"_gpuaas-challenge.{domain}", "TXT", token)
    assert (await verify(w, t, idp_id, domain)).status_code == 200
    r = await w.identity.client.post("/auth/token", data=login)
    assert r.status_code == 403 and r.json()["code"] == "sso_required", r.text


async def test_only_an_operator_vouches_by_hand(world: World) -> None:
    w = world
    t = await w.identity.tenant()
    domain = f"hand-{uuid.uuid4().hex[:6]}.example"
    r = await register_idp(w, t, domain, domains_verified=True)
    assert r.status_code == 403 and r.json()["code"] == "domain_attestation_forbidden", r.text
    r = await add_user(w, t, f"a@{domain}", email_verified=True)
    assert r.status_code == 403 and r.json()["code"] == "email_verification_forbidden", r.text
    assert (await add_user(w, t, f"b@{domain}")).status_code == 201
    r = await w.identity.client.post(
        f"/tenants/{t['tenant_id']}/users",
        json={"email": f"c@{domain}", "password": PASSWORD, "email_verified": True},
        headers=t["op"],
    )
    assert r.status_code == 201, r.text
    r = await register_idp(w, t, domain, domains_verified=True, headers=t["op"])
    assert r.status_code == 201 and r.json()["domain_claims"][0]["verified"] is True, r.text


def claims_of(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


async def oidc_login(w: World, client: dict[str, Any], email: str, scope: str = "openid email profile") -> Any:
    """identity as an OIDC provider: the authorization form posted, then the code exchanged."""
    verifier = secrets.token_urlsafe(48)
    params = {
        "client_id": client["client_id"],
        "redirect_uri": client["redirect_uris"][0],
        "scope": scope,
        "state": "s",
        "nonce": "n",
        "code_challenge": create_s256_code_challenge(verifier),
        "code_challenge_method": "S256",
    }
    r = await w.identity.client.post("/oauth/authorize", data={**params, "email": email, "password": PASSWORD})
    if r.status_code != 303:
        return r
    code = parse_qs(urlsplit(r.headers["location"]).query)["code"][0]
    return await w.identity.client.post(
        "/auth/token",
        data={
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": params["redirect_uri"],
            "code_verifier": verifier,
            "client_id": client["client_id"],
            "client_secret": client["client_secret"],
        },
    )


async def test_relying_parties_get_their_tenant_their_scopes_and_verified_emails_only(world: World) -> None:
    w = world
    t, other = await w.identity.tenant(), await w.identity.tenant()
    r = await w.identity.client.post(
        "/oauth-clients",
        json={"name": "rp", "redirect_uris": ["https://rp.example.com/cb"], "tenant_id": t["tenant_id"]},
        headers=t["op"],
    )
    assert r.status_code == 201 and r.json()["tenant_id"] == t["tenant_id"], r.text
    client = r.json()
    unverified, verified, outsider = (
        f"u-{t['slug']}@x.example",
        f"v-{t['slug']}@x.example",
        f"o-{t['slug']}@x.example",
    )
    assert (await add_user(w, t, unverified)).status_code == 201
    op_add = {"password": PASSWORD, "email_verified": True}
    r = await w.identity.client.post(
        f"/tenants/{t['tenant_id']}/users", json={"email": verified, **op_add}, headers=t["op"]
    )
    assert r.status_code == 201, r.text
    assert (await add_user(w, other, outsider)).status_code == 201

    # Another tenant's user: refused at the authorization endpoint.
    r = await oidc_login(w, client, outsider)
    assert r.status_code == 403 and 'data-code="access_denied"' in r.text, r.text
    # A platform scope cannot be asked for.
    r = await oidc_login(w, client, verified, scope="openid read")
    assert r.status_code == 400 and r.json()["code"] == "invalid_scope", r.text

    # The verified user: email in the ID token; the access token is the client's only.
    r = await oidc_login(w, client, verified)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["scope"] == "email openid profile"
    id_claims, access = claims_of(body["id_token"]), claims_of(body["access_token"])
    assert id_claims["email"] == verified and id_claims["email_verified"] is True
    assert access["aud"] == client["client_id"] and access["scope"] == "email openid profile"
    bearer = {"Authorization": f"Bearer {body['access_token']}"}
    r = await w.identity.client.get("/me", headers=bearer)  # not a platform token: the API refuses it
    assert r.status_code == 401, r.text
    info = await w.identity.client.get("/oauth/userinfo", headers=bearer)
    assert info.status_code == 200 and info.json()["email"] == verified, info.text

    # openid only: no email, no name, even for a verified user.
    r = await oidc_login(w, client, verified, scope="openid")
    assert r.status_code == 200, r.text
    assert {"email", "email_verified", "name"}.isdisjoint(claims_of(r.json()["id_token"]))
    info = await w.identity.client.get(
        "/oauth/userinfo", headers={"Authorization": f"Bearer {r.json()['access_token']}"}
    )
    assert info.status_code == 200 and set(info.json()) == {"sub"}, info.text

    # The unverified user: no email passed on at all.
    r = await oidc_login(w, client, unverified)
    assert r.status_code == 200, r.text
    assert "email" not in claims_of(r.json()["id_token"])
    info = await w.identity.client.get(
        "/oauth/userinfo", headers={"Authorization": f"Bearer {r.json()['access_token']}"}
    )
    assert "email" not in info.json(), info.text
