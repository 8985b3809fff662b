"""The SSO login code is bound to the client that started the login (RFC 7636 S256): `/auth/sso/start`
with `return_to` requires the client's `code_challenge`, and the `sso_login_code` grant requires its
`code_verifier`; a missing or wrong verifier is `invalid_grant` and spends the code.

Codes are inserted as the callback writes them (the callback itself needs an IdP: tests/e2e/test_identity_sso.py
runs the whole flow against a real one)."""

from __future__ import annotations

import secrets
import uuid
from datetime import timedelta
from typing import Any

import pytest
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from sqlalchemy import insert, select

from gpuaas.identity.credentials import new_secret, now, token_hash
from gpuaas.identity.models import sessions, sso_login_codes, sso_states
from gpuaas.kit.testing import wait_for

from .conftest import Identity

RETURN_TO = "http://127.0.0.1:45123/callback?cli_state=x"
VERIFIER = "v" * 43
CHALLENGE = create_s256_code_challenge(VERIFIER)


async def idp_of(identity: Identity, w: dict[str, Any]) -> str:
    """An IdP of the tenant with a proven domain (registering one contacts nobody)."""
    r = await identity.client.post(
        f"/tenants/{w['tenant_id']}/identity-providers",
        json={
            "name": "ACME",
            "issuer": "https://idp.invalid",
            "client_id": "gpuaas",
            "domains": [f"{w['slug']}.example"],
            "domains_verified": True,  # the operator attests (no DNS here: tests/security proves by DNS)
        },
        headers=w["op"],
    )
    assert r.status_code == 201, r.text
    return r.json()["idp_id"]


async def login_code(identity: Identity, user_id: str, idp_id: str, challenge: str | None) -> str:
    """A login code as the callback hands it to return_to, carrying the start's challenge."""
    code = new_secret("slc")
    async with identity.kit.sessions() as session, session.begin():
        await session.execute(
            insert(sso_login_codes).values(
                code_hash=token_hash(code),
                user_id=uuid.UUID(user_id),
                idp_id=uuid.UUID(idp_id),
                link_method="existing_link",
                return_to=RETURN_TO,
                code_challenge=challenge,
                expires_at=now() + timedelta(seconds=60),
            )
        )
    return code


async def exchange(identity: Identity, code: str, verifier: str | None) -> Any:
    data = {"grant_type": "sso_login_code", "code": code, **({"code_verifier": verifier} if verifier else {})}
    return await identity.client.post("/auth/token", data=data)


async def sso_sessions(identity: Identity, user_id: str) -> int:
    async with identity.kit.sessions() as session:
        rows = await session.execute(
            select(sessions.c.session_id).where(sessions.c.user_id == uuid.UUID(user_id), sessions.c.method == "sso")
        )
        return len(rows.all())


async def spent(identity: Identity, code: str) -> bool:
    async with identity.kit.sessions() as session:
        used = await session.scalar(
            select(sso_login_codes.c.used_at).where(sso_login_codes.c.code_hash == token_hash(code))
        )
    return used is not None


@pytest.mark.parametrize(
    "wrong",
    [
        None,  # missing
        "w" * 43,  # another client's verifier
        CHALLENGE,  # the challenge itself (seen in the start URL) is not the verifier
        "v" * 42,  # too short to be a verifier (RFC 7636: 43-128)
        "v" * 43 + "!",  # outside the unreserved set
    ],
)
async def test_wrong_or_missing_verifier_is_invalid_grant_and_burns_the_code(
    identity: Identity, wrong: str | None
) -> None:
    w = await identity.tenant()
    idp_id, user_id = await idp_of(identity, w), w["project_member_id"]
    code = await login_code(identity, user_id, idp_id, CHALLENGE)

    r = await exchange(identity, code, wrong)
    assert r.status_code == 400 and r.json()["code"] == "invalid_grant", r.text
    assert "access_token" not in r.json()
    assert await spent(identity, code)
    # Spent: the right verifier afterwards does not redeem it either; no session was opened.
    r = await exchange(identity, code, VERIFIER)
    assert r.status_code == 400 and r.json()["code"] == "invalid_grant", r.text
    assert await sso_sessions(identity, user_id) == 0

    # The refusal is audited against the user the code was for.
    reason = "code_verifier_missing" if wrong is None else "code_verifier_mismatch"

    async def audited() -> bool:
        r = await identity.client.get(
            "/audit",
            params={"tenant_id": w["tenant_id"], "action": "identity.session.create", "resource_id": user_id},
            headers=w["op"],
        )
        return any(i["outcome"] == "denied" and i["reason"] == reason for i in r.json()["items"])

    await wait_for(audited, 30, "the denied exchange's audit record")


async def test_right_verifier_signs_in_exactly_once(identity: Identity) -> None:
    w = await identity.tenant()
    idp_id, user_id = await idp_of(identity, w), w["project_member_id"]
    verifier = secrets.token_urlsafe(64)  # 86 characters
    code = await login_code(identity, user_id, idp_id, create_s256_code_challenge(verifier))

    r = await exchange(identity, code, verifier)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["refresh_token"] and body["session_id"] and body["link_method"] == "existing_link"
    me = await identity.client.get("/me", headers={"Authorization": f"Bearer {body['access_token']}"})
    assert me.status_code == 200 and me.json()["user_id"] == user_id
    r = await exchange(identity, code, verifier)
    assert r.status_code == 400 and r.json()["code"] == "invalid_grant"
    assert await sso_sessions(identity, user_id) == 1


async def test_code_without_challenge_needs_no_verifier(identity: Identity) -> None:
    """Only codes issued before identity_0005 carry no challenge (every start with return_to has one now)."""
    w = await identity.tenant()
    idp_id, user_id = await idp_of(identity, w), w["project_member_id"]
    code = await login_code(identity, user_id, idp_id, None)
    r = await exchange(identity, code, None)
    assert r.status_code == 200, r.text
    assert await sso_sessions(identity, user_id) == 1


@pytest.mark.parametrize(
    ("params", "status", "code"),
    [
        ({"return_to": RETURN_TO}, 400, "code_challenge_required"),
        ({"return_to": "/?sso=x", "code_challenge_method": "S256"}, 400, "invalid_code_challenge"),
        ({"return_to": RETURN_TO, "code_challenge": CHALLENGE}, 400, "invalid_code_challenge"),  # plain by default
        (
            {"return_to": RETURN_TO, "code_challenge": VERIFIER, "code_challenge_method": "plain"},
            400,
            "invalid_code_challenge",
        ),
        (
            {"return_to": RETURN_TO, "code_challenge": CHALLENGE[:-1], "code_challenge_method": "S256"},
            400,
            "invalid_code_challenge",
        ),
        (
            {"return_to": RETURN_TO, "code_challenge": CHALLENGE[:-1] + "=", "code_challenge_method": "S256"},
            400,
            "invalid_code_challenge",
        ),
        ({"code_challenge": CHALLENGE, "code_challenge_method": "S256"}, 400, "invalid_code_challenge"),  # no return_to
        # return_to is checked first: a foreign one is refused as such, challenge or not.
        ({"return_to": "https://evil.example/"}, 400, "invalid_return_to"),
        (
            {"return_to": "https://evil.example/", "code_challenge": CHALLENGE, "code_challenge_method": "S256"},
            400,
            "invalid_return_to",
        ),
    ],
)
async def test_start_requires_an_s256_challenge_with_return_to(
    identity: Identity, params: dict[str, str], status: int, code: str
) -> None:
    async with identity.kit.sessions() as session:
        before = len((await session.execute(select(sso_states.c.state))).all())
    r = await identity.client.get("/auth/sso/start", params={"idp_id": str(uuid.uuid4()), **params})
    assert r.status_code == status and r.json()["code"] == code, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    async with identity.kit.sessions() as session:
        assert len((await session.execute(select(sso_states.c.state))).all()) == before  # nothing stored


async def test_start_with_a_valid_challenge_goes_on_to_the_idp_lookup(identity: Identity) -> None:
    """A valid challenge passes validation: the next answer is about the (unknown) IdP."""
    params = {"return_to": RETURN_TO, "code_challenge": CHALLENGE, "code_challenge_method": "S256"}
    r = await identity.client.get("/auth/sso/start", params={"idp_id": str(uuid.uuid4()), **params})
    assert r.status_code == 404 and r.json()["code"] == "idp_not_found", r.text
