"""Account-type discovery (`/auth/discover`) and the listing of a tenant's identity providers."""

from __future__ import annotations

from .conftest import Identity
from .test_sso_login_code import idp_of


async def test_work_email_gets_only_what_login_needs(identity: Identity) -> None:
    """SSO and where to start it (with the IdP's label): never the tenant, and the hint is not compared."""
    w = await identity.tenant()
    idp_id = await idp_of(identity, w)
    r = await identity.client.get("/auth/discover", params={"email": f"a@{w['slug']}.example", "tenant": w["slug"]})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "email": f"a@{w['slug']}.example",
        "account_type": "work",
        "login": "sso",
        "tenant": None,
        "identity_provider": {
            "idp_id": idp_id,
            "name": "ACME",
            "enforce_sso": False,
            "sso_start_url": f"http://test-issuer/api/identity/auth/sso/start?idp_id={idp_id}",
        },
        "tenant_hint": None,
    }
    listed = await identity.client.get(f"/tenants/{w['tenant_id']}/identity-providers", headers=w["tenant_admin"])
    assert listed.status_code == 200, listed.text
    assert [(i["idp_id"], i["domains"], i["enabled"]) for i in listed.json()] == [
        (idp_id, [f"{w['slug']}.example"], True)
    ]


async def test_other_email_is_personal_and_the_hint_never_steers(identity: Identity) -> None:
    w = await identity.tenant()
    await idp_of(identity, w)
    r = await identity.client.get("/auth/discover", params={"email": "someone@gmail.com", "tenant": w["slug"]})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "email": "someone@gmail.com",
        "account_type": "personal",
        "login": "password",
        "tenant": None,
        "identity_provider": None,
        "tenant_hint": None,
    }
    r = await identity.client.get("/auth/discover", params={"email": "someone@gmail.com"})
    assert r.json()["tenant_hint"] is None
