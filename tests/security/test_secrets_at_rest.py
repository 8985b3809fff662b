"""Issue 17, defect 9: secrets at rest.

Token-signing keys and IdP client secrets (identity) and the terminal SSH CA key (allocations) are sealed
under the operator's keyring (gpuaas.kit.secrets_at_rest): the rows hold no clear text, clear rows of an
older version are sealed at start-up, a missing or wrong key stops the service with a clear message, and a
rotated keyring re-seals everything under the new key. Responses with secrets are never kept for
Idempotency-Key replays, and database errors are raised and logged without their parameters.

Real Postgres and a real broker (the session's `infra`); the services run in-process on their own schemas.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import asyncpg
import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from gpuaas.allocations.app import SPEC as ALLOCATIONS
from gpuaas.identity.app import SPEC as IDENTITY
from gpuaas.kit.app import ServiceSpec, create_app
from gpuaas.kit.db import create_engine, to_plain_url
from gpuaas.kit.secrets_at_rest import PREFIX, SecretsKeyError, generate_key_text
from gpuaas.kit.testing import key_settings, new_service_db, running

ISSUER = "http://test-issuer/api/identity"
ADMIN = ("op@secrets.test", "operator-password-1")
IDP_SECRET = "idp-client-secret-" + uuid.uuid4().hex


def app_on(spec: ServiceSpec, infra: Any, schema: str, url: str, keys: str, **overrides: Any) -> FastAPI:
    """The service on an existing schema (a restart), with the keyring `keys`."""
    extra: dict[str, Any] = {}
    if spec is IDENTITY:
        extra = {"public_url": ISSUER, "bootstrap_admin_email": ADMIN[0], "bootstrap_admin_password": ADMIN[1]}
    settings = spec.settings_cls(
        database_url=url,
        db_schema=schema,
        kafka_bootstrap=infra.kafka_bootstrap,
        consumer_group=schema,
        jwt_issuer=ISSUER,
        log_json=False,
        **{**key_settings(spec.name), "secrets_keys": keys, **extra, **overrides},
    )
    return create_app(settings, spec)


async def raw(url: str, schema: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(to_plain_url(url), server_settings={"search_path": schema})
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


async def admin_headers(client: httpx.AsyncClient) -> dict[str, str]:
    r = await client.post("/auth/token", data={"grant_type": "password", "username": ADMIN[0], "password": ADMIN[1]})
    assert r.status_code == 200, r.text
    return {"Authorization": f"Bearer {r.json()['access_token']}"}


async def login_works(app: FastAPI) -> None:
    """Identity signs with its (sealed) key and verifies its own token: the key opened correctly."""
    async with running(app, wait_consumer=False) as (client, kit):
        kit.verifier.jwks.set((await client.get("/.well-known/jwks.json")).json())
        me = await client.get("/me", headers=await admin_headers(client))
        assert me.status_code == 200, me.text


async def start_fails(app: FastAPI) -> str:
    with pytest.raises(SecretsKeyError) as refused:
        async with app.router.lifespan_context(app):
            pass
    return str(refused.value)


@pytest.fixture(scope="module")
async def identity_db(infra: Any) -> dict[str, str]:
    """An identity schema that has run once (its keyring: `keys`, updated by the rotation test), with a
    tenant IdP holding a client secret."""
    schema, url = await new_service_db(infra.admin_url, "sec_identity", IDENTITY)
    keys = generate_key_text("first")
    async with running(app_on(IDENTITY, infra, schema, url, keys), wait_consumer=False) as (client, kit):
        kit.verifier.jwks.set((await client.get("/.well-known/jwks.json")).json())
        op = await admin_headers(client)
        slug = f"s-{uuid.uuid4().hex[:8]}"
        tenant = await client.post("/tenants", json={"slug": slug, "name": slug}, headers=op)
        assert tenant.status_code == 201, tenant.text
        idp = await client.post(
            f"/tenants/{tenant.json()['tenant_id']}/identity-providers",
            json={
                "name": "ACME",
                "issuer": "https://idp.invalid",
                "client_id": "gpuaas",
                "client_secret": IDP_SECRET,
                "domains": [f"{slug}.example"],
                "domains_verified": True,
            },
            headers=op,
        )
        assert idp.status_code == 201, idp.text
        assert IDP_SECRET not in idp.text
    return {"schema": schema, "url": url, "keys": keys}


async def test_identity_rows_hold_no_clear_secret(infra: Any, identity_db: dict[str, str]) -> None:
    schema, url = identity_db["schema"], identity_db["url"]
    keys = await raw(
        url, schema, "SELECT kid, private_jwk::text AS private, public_jwk::text AS public FROM signing_keys"
    )
    assert keys
    for row in keys:
        private = json.loads(row["private"])
        assert set(private) == {"sealed"} and private["sealed"].startswith(PREFIX + "first:")
        assert json.loads(row["public"])["x"] not in row["private"]  # not even the public part shows
    (idp,) = await raw(url, schema, "SELECT client_secret FROM identity_providers")
    assert idp["client_secret"].startswith(PREFIX) and IDP_SECRET not in idp["client_secret"]
    dump = await raw(url, schema, "SELECT string_agg(t::text, '') AS all FROM identity_providers t")
    assert IDP_SECRET not in dump[0]["all"]


async def test_clear_rows_of_an_older_version_are_sealed_at_start(infra: Any, identity_db: dict[str, str]) -> None:
    """Encrypt-at-start (documented in docs/operations.md): an older version left clear rows; the new one
    seals them in place before serving and keeps using the same keys."""
    from gpuaas.identity.keys import IDP_CLIENT_SECRET, PRIVATE_JWK
    from gpuaas.kit.secrets_at_rest import Keyring

    schema, url, keys = identity_db["schema"], identity_db["url"], identity_db["keys"]
    ring = Keyring.parse(keys)
    for row in await raw(url, schema, "SELECT kid, private_jwk FROM signing_keys"):
        clear = ring.open_json(json.loads(row["private_jwk"]), f"{PRIVATE_JWK}:{row['kid']}")
        await raw(
            url, schema, "UPDATE signing_keys SET private_jwk = $1::jsonb WHERE kid = $2", json.dumps(clear), row["kid"]
        )
    (idp,) = await raw(url, schema, "SELECT idp_id, client_secret FROM identity_providers")
    clear_secret = ring.open(idp["client_secret"], f"{IDP_CLIENT_SECRET}:{idp['idp_id']}")
    await raw(url, schema, "UPDATE identity_providers SET client_secret = $1", clear_secret)
    assert '"d"' in (await raw(url, schema, "SELECT private_jwk::text AS p FROM signing_keys"))[0]["p"]  # clear now

    await login_works(app_on(IDENTITY, infra, schema, url, keys))

    for row in await raw(url, schema, "SELECT private_jwk::text AS p FROM signing_keys"):
        assert '"d"' not in row["p"] and PREFIX in row["p"]
    (idp,) = await raw(url, schema, "SELECT idp_id, client_secret FROM identity_providers")
    assert idp["client_secret"].startswith(PREFIX)
    assert ring.open(idp["client_secret"], f"{IDP_CLIENT_SECRET}:{idp['idp_id']}") == IDP_SECRET


async def test_missing_or_wrong_key_is_refused(infra: Any, identity_db: dict[str, str]) -> None:
    schema, url = identity_db["schema"], identity_db["url"]
    assert "GPUAAS_SECRETS_KEYS is not set" in await start_fails(app_on(IDENTITY, infra, schema, url, ""))
    other = await start_fails(app_on(IDENTITY, infra, schema, url, generate_key_text("other")))
    assert "'first'" in other and "does not hold" in other
    same_id_other_bytes = await start_fails(app_on(IDENTITY, infra, schema, url, generate_key_text("first")))
    assert "does not open" in same_id_other_bytes
    published = await start_fails(
        app_on(IDENTITY, infra, schema, url, "dev:ZGV2LW9ubHkta2VrLWRvLW5vdC11c2UtaW4tcHJvZCE=")
    )
    assert "published development key" in published
    rows = await raw(url, schema, "SELECT private_jwk::text AS p FROM signing_keys")
    assert all(PREFIX + "first:" in r["p"] for r in rows)  # a refused start changed nothing


async def test_rotation_reseals_under_the_new_key(infra: Any, identity_db: dict[str, str]) -> None:
    schema, url, old = identity_db["schema"], identity_db["url"], identity_db["keys"]
    new = generate_key_text("second")
    await login_works(app_on(IDENTITY, infra, schema, url, f"{new},{old}"))  # new first, old still held
    rows = await raw(url, schema, "SELECT private_jwk::text AS p FROM signing_keys")
    assert rows and all(PREFIX + "second:" in r["p"] for r in rows)
    (idp,) = await raw(url, schema, "SELECT client_secret FROM identity_providers")
    assert idp["client_secret"].startswith(PREFIX + "second:")
    await login_works(app_on(IDENTITY, infra, schema, url, new))  # the old key can now be dropped
    identity_db["keys"] = new
    assert "does not hold" in await start_fails(app_on(IDENTITY, infra, schema, url, old))


async def test_terminal_ssh_ca_key_is_sealed_and_an_older_clear_key_is_sealed_at_start(infra: Any) -> None:
    schema, url = await new_service_db(infra.admin_url, "sec_alloc", ALLOCATIONS)
    keys = generate_key_text("a1")
    async with running(app_on(ALLOCATIONS, infra, schema, url, keys)) as (_, kit):
        public = kit.state.terminal_ca.public
    (row,) = await raw(url, schema, "SELECT private_key, public_key FROM platform_keys")
    assert row["private_key"].startswith(PREFIX + "a1:") and "PRIVATE KEY" not in row["private_key"]
    # As an older version stored it: clear. The next start seals it and keeps the same CA.
    from gpuaas.allocations.service.access import PLATFORM_KEY_CONTEXT, TERMINAL_CA
    from gpuaas.kit.secrets_at_rest import Keyring

    clear = Keyring.parse(keys).open(row["private_key"], f"{PLATFORM_KEY_CONTEXT}:{TERMINAL_CA}")
    await raw(url, schema, "UPDATE platform_keys SET private_key = $1", clear)
    async with running(app_on(ALLOCATIONS, infra, schema, url, keys)) as (_, kit):
        assert kit.state.terminal_ca.public == public
    (row,) = await raw(url, schema, "SELECT private_key FROM platform_keys")
    assert row["private_key"].startswith(PREFIX) and "PRIVATE KEY" not in row["private_key"]
    assert "GPUAAS_SECRETS_KEYS is not set" in await start_fails(app_on(ALLOCATIONS, infra, schema, url, ""))


async def test_idempotent_responses_keep_no_secret(infra: Any, identity_db: dict[str, str]) -> None:
    schema, url = identity_db["schema"], identity_db["url"]
    app = app_on(IDENTITY, infra, schema, url, identity_db["keys"])
    async with running(app, wait_consumer=False) as (client, kit):
        kit.verifier.jwks.set((await client.get("/.well-known/jwks.json")).json())
        op = await admin_headers(client)
        slug = f"i-{uuid.uuid4().hex[:8]}"
        tenant = await client.post("/tenants", json={"slug": slug, "name": slug}, headers=op)
        project = await client.post(
            f"/tenants/{tenant.json()['tenant_id']}/projects",
            json={"name": "main"},
            headers={**op, "Idempotency-Key": f"p-{slug}"},
        )
        assert project.status_code == 201, project.text
        again = await client.post(
            f"/tenants/{tenant.json()['tenant_id']}/projects",
            json={"name": "main"},
            headers={**op, "Idempotency-Key": f"p-{slug}"},
        )
        assert again.status_code == 201 and again.headers.get("idempotent-replayed") == "true"  # no secret: kept
        key = f"sa-{slug}"
        path = f"/projects/{project.json()['project_id']}/service-accounts"
        sa = await client.post(path, json={"name": "ci", "scopes": ["read"]}, headers={**op, "Idempotency-Key": key})
        assert sa.status_code == 201, sa.text
        secret = sa.json()["client_secret"]
        stored = await raw(url, schema, "SELECT status_code, response_body FROM idempotency_keys WHERE key = $1", key)
        assert stored[0]["status_code"] == 201 and secret.encode() not in stored[0]["response_body"]
        dump = await raw(url, schema, "SELECT string_agg(t::text, '') AS all FROM idempotency_keys t")
        assert secret not in dump[0]["all"]
        retry = await client.post(path, json={"name": "ci", "scopes": ["read"]}, headers={**op, "Idempotency-Key": key})
        # The resource again, its secret left out and said to be (issue 28; before: 409 idempotency_response_not_kept).
        assert retry.status_code == 201 and retry.headers.get("idempotent-replayed") == "true", retry.text
        assert retry.json()["client_secret"] is None and retry.json()["secret_not_shown_again"] == ["client_secret"]
        assert retry.json()["service_account_id"] == sa.json()["service_account_id"]
        assert secret not in retry.text


async def test_database_errors_carry_no_parameters(infra: Any) -> None:
    schema, url = await new_service_db(infra.admin_url, "sec_db", None)
    engine = create_engine(url, schema, pool_size=1)
    secret = "secret-" + uuid.uuid4().hex
    insert = text(
        "INSERT INTO idempotency_keys (principal, key, method, path, request_hash) VALUES ('p', 'k', 'POST', '/', :h)"
    )
    try:
        async with engine.begin() as conn:
            await conn.execute(insert, {"h": secret})
        with pytest.raises(DBAPIError) as failed:
            async with engine.begin() as conn:
                await conn.execute(insert, {"h": secret})  # duplicate key
        assert "duplicate key" in str(failed.value)
        assert secret not in str(failed.value) and "hidden due to hide_parameters" in str(failed.value)
    finally:
        await engine.dispose()


@pytest.mark.integration
async def test_identity_moves_its_keyring_to_vault_and_rotates_there(infra: Any, vault: Any) -> None:
    """The `vault` key source on a real OpenBao (this test's own mounts): identity started with the env keyring,
    then with the same data key wrapped by its Transit key in KV (and its signing key in KV), logging in with
    its AppRole under the committed policy and nothing in GPUAAS_SECRETS_KEYS — its rows still open; a new
    data key added in Vault re-seals them at the next start."""
    from gpuaas.kit.event_signing import generate_seed
    from gpuaas.kit.vault import TransitKey, VaultClient
    from gpuaas.kit.vault_keys import wrap_new_key

    schema, url = await new_service_db(infra.admin_url, "sec_identity_vault", IDENTITY)
    env_keys = generate_key_text("first")
    await login_works(app_on(IDENTITY, infra, schema, url, env_keys))

    vault.transit_key("identity")
    transit = TransitKey(VaultClient(vault.token_config()), vault.transit, "identity")
    kid, _, key_b64 = env_keys.partition(":")
    wrapped = transit.wrap(base64.b64decode(key_b64), f"identity:{kid}".encode())
    vault.put("identity/secrets-keys", keys=f"{kid}:{wrapped}")
    vault.put("identity/event-signing", seed=generate_seed())
    role = vault.approle("gpuaas-identity", vault.service_policy("identity"))
    from_vault: dict[str, Any] = {
        "secrets_key_source": "vault",
        "event_signing_key": "",
        "vault_url": role.url,
        "vault_role_id": role.role_id,
        "vault_secret_id": role.secret_id,
        "vault_approle_mount": role.approle_mount,
        "vault_kv_mount": vault.kv,
        "vault_transit_mount": vault.transit,
    }
    await login_works(app_on(IDENTITY, infra, schema, url, "", **from_vault))  # the same rows, keys from Vault
    rows = await raw(url, schema, "SELECT private_jwk::text AS p FROM signing_keys")
    assert rows and all(PREFIX + "first:" in r["p"] for r in rows)

    vault.put("identity/secrets-keys", keys=wrap_new_key(f"{kid}:{wrapped}", transit, "identity", "second"))
    await login_works(app_on(IDENTITY, infra, schema, url, "", **from_vault))
    rows = await raw(url, schema, "SELECT private_jwk::text AS p FROM signing_keys")
    assert all(PREFIX + "second:" in r["p"] for r in rows)  # re-sealed under the new data key at start
