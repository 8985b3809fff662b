"""Logins, refresh rotation with reuse detection, logout, sessions, lockout, service accounts, keys."""

from __future__ import annotations

import asyncio
import uuid

from joserfc import jwt
from joserfc.jwk import KeySet
from sqlalchemy import text

from gpuaas.kit.testing import wait_for

from .conftest import ADMIN_EMAIL, PASSWORD, Identity


def claims_of(identity_jwks: dict, token: str) -> dict:
    return jwt.decode(token, KeySet.import_key_set(identity_jwks)).claims


async def test_discovery_document_and_jwks(identity: Identity) -> None:
    doc = (await identity.client.get("/.well-known/openid-configuration")).json()
    assert doc["issuer"] == "http://test-issuer/api/identity"
    assert doc["code_challenge_methods_supported"] == ["S256"]
    assert {"authorization_code", "refresh_token", "client_credentials"} <= set(doc["grant_types_supported"])
    keys = (await identity.client.get("/.well-known/jwks.json")).json()["keys"]
    assert keys and all("d" not in k for k in keys)  # never a private part


async def test_password_refresh_rotation_reuse_and_logout(identity: Identity) -> None:
    w = await identity.tenant()
    first = await identity.login(w["project_member_email"], **{"User-Agent": "pytest-ua"})
    jwks = (await identity.client.get("/.well-known/jwks.json")).json()
    claims = claims_of(jwks, first["access_token"])
    assert claims["typ"] == "user" and claims["sid"] == first["session_id"] and claims["tenant_id"] == w["tenant_id"]

    r = await identity.client.post(
        "/auth/token", data={"grant_type": "refresh_token", "refresh_token": first["refresh_token"]}
    )
    assert r.status_code == 200, r.text
    second = r.json()
    assert second["refresh_token"] != first["refresh_token"] and second["session_id"] == first["session_id"]

    # The spent token presented again: reuse -> the whole session is revoked, the newer token dies too.
    r = await identity.client.post(
        "/auth/token", data={"grant_type": "refresh_token", "refresh_token": first["refresh_token"]}
    )
    assert r.status_code == 401 and r.json()["code"] == "refresh_token_reused"
    r = await identity.client.post(
        "/auth/token", data={"grant_type": "refresh_token", "refresh_token": second["refresh_token"]}
    )
    assert r.status_code == 401 and r.json()["code"] == "session_revoked"
    # The session's access tokens die with it, at once (the deny list), not at their expiry.
    for dead in (first, second):
        r = await identity.client.get("/sessions", headers={"Authorization": f"Bearer {dead['access_token']}"})
        assert r.status_code == 401 and r.json()["code"] == "session_revoked"
        assert r.headers["content-type"].startswith("application/problem+json")
    third = await identity.login(w["project_member_email"])
    auth = {"Authorization": f"Bearer {third['access_token']}"}
    sessions = (await identity.client.get("/sessions", headers=auth)).json()
    mine = next(s for s in sessions if s["session_id"] == first["session_id"])
    assert mine["revoked"] and mine["revoked_reason"] == "refresh_token_reuse" and mine["user_agent"] == "pytest-ua"

    # Logout with the access token ends that session: its refresh token and access token no longer work.
    r = await identity.client.post("/auth/logout", headers=auth)
    assert r.status_code == 204
    r = await identity.client.post(
        "/auth/token", data={"grant_type": "refresh_token", "refresh_token": third["refresh_token"]}
    )
    assert r.status_code == 401 and r.json()["code"] == "session_revoked"
    assert (await identity.client.get("/me", headers=auth)).status_code == 401
    third = await identity.login(w["project_member_email"])
    auth = {"Authorization": f"Bearer {third['access_token']}"}

    # Own sessions can be listed and revoked; someone else's is a 404.
    fourth = await identity.login(w["project_member_email"])
    listed = (await identity.client.get("/sessions", headers=auth)).json()
    assert fourth["session_id"] in {s["session_id"] for s in listed}
    other = await identity.client.delete(f"/sessions/{fourth['session_id']}", headers=w["tenant_admin"])
    assert other.status_code == 404
    r = await identity.client.delete(f"/sessions/{fourth['session_id']}", headers=auth)
    assert r.status_code == 204
    r = await identity.client.post(
        "/auth/token", data={"grant_type": "refresh_token", "refresh_token": fourth["refresh_token"]}
    )
    assert r.json()["code"] == "session_revoked"


async def test_login_errors_and_lockout(identity: Identity) -> None:
    w = await identity.tenant()
    email = w["project_member_email"]
    bad = {"grant_type": "password", "username": email, "password": "wrong password!"}
    r = await identity.client.post("/auth/token", data={**bad, "username": "nobody@nowhere.example"})
    assert r.status_code == 401 and r.json()["code"] == "invalid_credentials"
    for _ in range(3):  # lockout_threshold=3 in this module
        r = await identity.client.post("/auth/token", data=bad)
        assert r.status_code == 401 and r.json()["code"] == "invalid_credentials"
    # This source backs off from this account (even with the right password), with how long to wait...
    r = await identity.client.post("/auth/token", data={**bad, "password": PASSWORD})
    assert r.status_code == 429 and r.json()["code"] == "login_backoff" and r.json()["retry_after_s"] > 0
    assert int(r.headers["retry-after"]) == r.json()["retry_after_s"]
    # ...but the account is not locked: the right password from another address logs in.
    other = {"X-Forwarded-For": "203.0.113.9"}  # the test client is a trusted proxy (loopback)
    r = await identity.client.post("/auth/token", data={**bad, "password": PASSWORD}, headers=other)
    assert r.status_code == 200, r.text
    # Other accounts are unaffected.
    await identity.login(w["tenant_admin_email"])
    r = await identity.client.post("/auth/token", data={"grant_type": "magic"})
    assert r.status_code == 400 and r.json()["code"] == "unsupported_grant_type"
    r = await identity.client.post("/auth/token", data={"grant_type": "password"})
    assert r.status_code == 422


async def test_disabled_user_cannot_log_in_and_sessions_end(identity: Identity) -> None:
    w = await identity.tenant()
    tokens = await identity.login(w["project_member_email"])
    r = await identity.client.post(f"/users/{w['project_member_id']}/disable", headers=w["tenant_admin"])
    assert r.status_code == 200 and r.json()["status"] == "disabled"
    r = await identity.client.post(
        "/auth/token", data={"grant_type": "password", "username": w["project_member_email"], "password": PASSWORD}
    )
    assert r.status_code == 403 and r.json()["code"] == "account_disabled"
    r = await identity.client.post(
        "/auth/token", data={"grant_type": "refresh_token", "refresh_token": tokens["refresh_token"]}
    )
    assert r.json()["code"] == "session_revoked"
    # Its access tokens are refused at once: /me and writes (an SSH key would be next), not at their expiry.
    auth = {"Authorization": f"Bearer {tokens['access_token']}"}
    assert (await identity.client.get("/me", headers=auth)).status_code == 401
    # The member may not manage users (its token is dead anyway); another tenant's admin does not even see the user.
    r = await identity.client.post(f"/users/{w['tenant_admin_id']}/disable", headers=w["project_member"])
    assert r.status_code == 401 and r.json()["code"] in ("session_revoked", "token_revoked")
    other = await identity.tenant()
    r = await identity.client.post(f"/users/{w['project_member_id']}/enable", headers=other["tenant_admin"])
    assert r.status_code == 404


async def test_service_account_client_credentials_rotation_disable(identity: Identity) -> None:
    w = await identity.tenant()
    pid = w["project_id"]
    r = await identity.client.post(
        f"/projects/{pid}/service-accounts", json={"name": "ctl", "scopes": ["nope"]}, headers=w["tenant_admin"]
    )
    assert r.status_code == 422 and r.json()["code"] == "invalid_scope"
    r = await identity.client.post(
        f"/projects/{pid}/service-accounts",
        json={"name": "ctl", "scopes": ["app-controller", "read"]},
        headers=w["project_member"],
    )
    assert r.status_code == 403
    r = await identity.client.post(
        f"/projects/{pid}/service-accounts",
        json={"name": "ctl", "scopes": ["app-controller", "read"]},
        headers=w["tenant_admin"],
    )
    assert r.status_code == 201, r.text
    sa = r.json()
    form = {"grant_type": "client_credentials", "client_id": sa["client_id"], "client_secret": sa["client_secret"]}
    r = await identity.client.post("/auth/token", data={**form, "scope": "read"})
    assert r.status_code == 200, r.text
    claims = claims_of((await identity.client.get("/.well-known/jwks.json")).json(), r.json()["access_token"])
    assert claims["typ"] == "service_account" and claims["project_id"] == pid and claims["scope"] == "read"
    assert claims["tenant_id"] == w["tenant_id"] and "refresh_token" not in r.json()
    # HTTP Basic works too; a scope it was not granted does not.
    r = await identity.client.post(
        "/auth/token",
        data={"grant_type": "client_credentials", "scope": "allocations"},
        auth=(sa["client_id"], sa["client_secret"]),
    )
    assert r.status_code == 400 and r.json()["code"] == "invalid_scope"
    # The token is honoured by the kit (scope-checked, own project only).
    sa_auth = {
        "Authorization": f"Bearer {(await identity.client.post('/auth/token', data=form)).json()['access_token']}"
    }
    assert (await identity.client.get(f"/projects/{pid}", headers=sa_auth)).status_code == 200

    r = await identity.client.post(f"/service-accounts/{sa['client_id']}/rotate-secret", headers=w["tenant_admin"])
    assert r.status_code == 200
    new_secret = r.json()["client_secret"]
    r = await identity.client.post("/auth/token", data=form)
    assert r.status_code == 401 and r.json()["code"] == "invalid_client"
    # Tokens issued with the old secret are revoked with it (not left to run out).
    r = await identity.client.get(f"/projects/{pid}", headers=sa_auth)
    assert r.status_code == 401 and r.json()["code"] == "token_revoked"
    await asyncio.sleep(1.0)  # "not before" is compared with iat in whole seconds: a new second
    fresh = await identity.client.post("/auth/token", data={**form, "client_secret": new_secret})
    assert fresh.status_code == 200
    sa_auth = {"Authorization": f"Bearer {fresh.json()['access_token']}"}
    assert (await identity.client.get(f"/projects/{pid}", headers=sa_auth)).status_code == 200

    r = await identity.client.post(f"/service-accounts/{sa['client_id']}/disable", headers=w["tenant_admin"])
    assert r.status_code == 200 and r.json()["disabled"] is True
    r = await identity.client.post("/auth/token", data={**form, "client_secret": new_secret})
    assert r.status_code == 403 and r.json()["code"] == "client_disabled"
    # Its still-valid token is denied at once (the deny list, then the projection that says disabled).
    r = await identity.client.get(f"/projects/{pid}", headers=sa_auth)
    assert r.status_code == 401 and r.json()["code"] == "token_revoked"
    listed = (await identity.client.get(f"/projects/{pid}/service-accounts", headers=w["tenant_admin"])).json()
    assert [s["name"] for s in listed] == ["ctl"] and "client_secret" not in listed[0]


async def test_key_rotation_keeps_old_tokens_valid(identity: Identity) -> None:
    admin = await identity.admin()
    before = (await identity.client.get("/.well-known/jwks.json")).json()
    r = await identity.client.post("/keys/rotate", headers=admin)
    assert r.status_code == 200, r.text
    new_kid = r.json()["kid"]
    after = (await identity.client.get("/.well-known/jwks.json")).json()
    kids = [k["kid"] for k in after["keys"]]
    assert kids[0] == new_kid and {k["kid"] for k in before["keys"]} <= set(kids)
    identity.kit.verifier.jwks.set(after)
    assert (await identity.client.get("/me", headers=admin)).status_code == 200  # signed by the old key
    fresh = await identity.admin()
    header = jwt.decode(fresh["Authorization"].split()[1], KeySet.import_key_set(after)).header
    assert header["kid"] == new_kid
    assert (await identity.client.get("/me", headers=fresh)).json()["email"] == ADMIN_EMAIL


async def test_audit_store_filters(identity: Identity) -> None:
    w = await identity.tenant()
    other = await identity.tenant()
    tid = w["tenant_id"]

    async def stored() -> bool:
        r = await identity.client.get(
            "/audit", params={"tenant_id": tid, "action": "identity.membership.grant"}, headers=w["tenant_admin"]
        )
        return r.status_code == 200 and r.json()["total"] >= 2

    await wait_for(stored, 30, "audit records through the broker")
    r = await identity.client.get(
        "/audit",
        params={"tenant_id": tid, "project_id": w["project_id"], "resource_type": "membership"},
        headers=w["tenant_admin"],
    )
    items = r.json()["items"]
    assert items and all(i["project_id"] == w["project_id"] and i["resource_type"] == "membership" for i in items)
    op_id = (await identity.client.get("/me", headers=w["op"])).json()["user_id"]
    r = await identity.client.get(
        "/audit", params={"tenant_id": tid, "actor_id": op_id, "since": "2020-01-01T00:00:00Z"}, headers=w["op"]
    )
    assert r.json()["total"] >= 3 and all(i["actor_id"] == op_id for i in r.json()["items"])
    r = await identity.client.get("/audit", params={"tenant_id": tid, "until": "2020-01-01T00:00:00Z"}, headers=w["op"])
    assert r.json()["total"] == 0
    # Tenant admins: their tenant only; another tenant is invisible; members may not read it.
    assert (await identity.client.get("/audit", headers=w["tenant_admin"])).json()["code"] == "tenant_required"
    r = await identity.client.get("/audit", params={"tenant_id": other["tenant_id"]}, headers=w["tenant_admin"])
    assert r.status_code == 404
    r = await identity.client.get("/audit", params={"tenant_id": tid}, headers=w["project_member"])
    assert r.status_code == 403
    r = await identity.client.get("/audit", params={"tenant_id": tid, "since": "2020-01-01T00:00:00"}, headers=w["op"])
    assert r.status_code == 422 and r.json()["code"] == "naive_datetime"
    # Operators see all tenants.
    r = await identity.client.get("/audit", params={"action": "identity.tenant.create"}, headers=w["op"])
    assert {i["tenant_id"] for i in r.json()["items"]} >= {tid, other["tenant_id"]}


async def test_tenant_reads_and_visibility(identity: Identity) -> None:
    w = await identity.tenant()
    other = await identity.tenant()
    tid = w["tenant_id"]
    p2 = await identity.client.post(f"/tenants/{tid}/projects", json={"name": "second"}, headers=w["tenant_admin"])
    assert p2.status_code == 201
    names = [
        p["name"] for p in (await identity.client.get(f"/tenants/{tid}/projects", headers=w["tenant_admin"])).json()
    ]
    assert names == ["main", "second"]
    names = [
        p["name"] for p in (await identity.client.get(f"/tenants/{tid}/projects", headers=w["project_member"])).json()
    ]
    assert names == ["main"]
    r = await identity.client.get(f"/tenants/{tid}/projects", headers=other["tenant_admin"])
    assert r.status_code == 404
    mine = (await identity.client.get("/tenants", headers=w["project_member"])).json()
    assert [t["tenant_id"] for t in mine] == [tid]
    members = (await identity.client.get(f"/projects/{w['project_id']}/members", headers=w["project_member"])).json()
    assert [m["email"] for m in members] == [w["project_member_email"]]
    assert all(isinstance(m["display_name"], str) for m in members)  # the console's member picker shows it
    me = (await identity.client.get("/me", headers=w["project_member"])).json()
    assert me["tenant_id"] == tid and me["memberships"][0]["role"] == "project_member"
    # duplicate email and bad input: 4xx, never a partial write
    r = await identity.client.post(
        f"/tenants/{tid}/users",
        json={"email": w["project_member_email"], "password": PASSWORD},
        headers=w["tenant_admin"],
    )
    assert r.status_code == 409 and r.json()["code"] == "email_taken"
    r = await identity.client.post(
        f"/tenants/{tid}/members", json={"user_id": str(uuid.uuid4()), "role": "viewer"}, headers=w["tenant_admin"]
    )
    assert r.status_code == 404
    async with identity.kit.sessions() as s:
        n = await s.scalar(
            text("SELECT count(*) FROM users WHERE lower(email) = lower(:e)"), {"e": w["project_member_email"]}
        )
    assert n == 1
