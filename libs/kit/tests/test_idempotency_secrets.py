"""Idempotency-Key and secrets (issue 28): a secret shown once (a node token, a service account's client
secret) is never stored for replay — the stored response has it redacted, and a replay answers with the
resource plus `secret_not_shown_again` (and the `Secret-Not-Shown-Again` header) naming what was left out;
an Idempotency-Key on a call without credentials is refused (anonymous callers shared one scope).

Before: a replay of a host enrolment's key returned the same node token, stored in clear.
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any

import pytest
from fastapi import APIRouter
from sqlalchemy import text

from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.kit.testing import build, new_service_db, running

pytestmark = pytest.mark.integration


def secrets_router() -> APIRouter:
    router = APIRouter()

    @router.post("/hosts", status_code=201)
    async def enrol(principal: CurrentPrincipal) -> dict[str, Any]:
        return {"host_id": str(uuid.uuid4()), "name": "gpu-1", "node_token": secrets.token_urlsafe(32)}

    @router.post("/service-accounts", status_code=201)
    async def service_account(principal: CurrentPrincipal) -> dict[str, Any]:
        return {"service_account_id": str(uuid.uuid4()), "credential": {"client_secret": secrets.token_hex(16)}}

    @router.post("/public", status_code=201)
    async def public() -> dict[str, str]:
        return {"id": str(uuid.uuid4())}

    return router


@pytest.fixture
async def app_client(infra, signer):
    name, url = await new_service_db(infra.admin_url, "idemsec")
    app = build(name, url, infra.kafka_bootstrap, with_iam=False, routers=[secrets_router()])
    async with running(app, jwks=signer.jwks) as (client, kit):
        yield client, kit


async def stored_bodies(kit: Any, key: str) -> list[bytes]:
    async with kit.sessions() as s:
        rows = await s.execute(text("SELECT response_body FROM idempotency_keys WHERE key = :k"), {"k": key})
        return [bytes(r[0]) for r in rows if r[0] is not None]


@pytest.mark.parametrize(
    ("path", "secret_of", "redacted"),
    [
        ("/hosts", lambda b: b["node_token"], ["node_token"]),
        ("/service-accounts", lambda b: b["credential"]["client_secret"], ["credential.client_secret"]),
    ],
)
async def test_a_replay_never_shows_a_secret_again(app_client, signer, path, secret_of, redacted) -> None:
    client, kit = app_client
    key = f"enrol-{uuid.uuid4().hex}"
    h = {"Authorization": f"Bearer {signer.token(uuid.uuid4())}", "Idempotency-Key": key}
    first = await client.post(path, headers=h)
    assert first.status_code == 201, first.text
    secret = secret_of(first.json())
    assert secret and "secret_not_shown_again" not in first.json()

    again = await client.post(path, headers=h)
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true", again.text
    body = again.json()
    assert secret not in again.text
    assert secret_of(body) is None  # the resource, with the secret left out...
    assert body["secret_not_shown_again"] == redacted  # ...and saying so
    assert again.headers["secret-not-shown-again"] == ", ".join(redacted)
    assert {k: v for k, v in body.items() if k not in ("secret_not_shown_again", "node_token", "credential")} == {
        k: v for k, v in first.json().items() if k not in ("node_token", "credential")
    }
    stored = await stored_bodies(kit, key)
    assert stored and all(secret.encode() not in b for b in stored)  # never at rest in the store


async def test_an_idempotency_key_without_credentials_is_refused(app_client) -> None:
    """Anonymous callers shared one scope ("anonymous"): one could get another's stored response, or a 422
    for a key someone else used. Keys are for authenticated callers only."""
    client, kit = app_client
    key = f"anon-{uuid.uuid4().hex}"
    r = await client.post("/public", headers={"Idempotency-Key": key})
    assert r.status_code == 400 and r.json()["code"] == "idempotency_key_needs_credentials", r.text
    async with kit.sessions() as s:
        n = (await s.execute(text("SELECT count(*) FROM idempotency_keys WHERE key = :k"), {"k": key})).scalar_one()
    assert n == 0
    # Without the header the anonymous call is served as always.
    assert (await client.post("/public")).status_code == 201


async def test_an_unverifiable_token_gets_the_routes_401_and_stores_nothing(app_client) -> None:
    """An expired or foreign token is not a caller's scope either: the route answers (401, so a client
    refreshes its token and retries with the same key) and no key is reserved for it."""
    client, kit = app_client
    key = f"stale-{uuid.uuid4().hex}"
    r = await client.post("/hosts", headers={"Authorization": "Bearer not-a-jwt", "Idempotency-Key": key})
    assert r.status_code == 401, r.text
    async with kit.sessions() as s:
        n = (await s.execute(text("SELECT count(*) FROM idempotency_keys WHERE key = :k"), {"k": key})).scalar_one()
    assert n == 0
