"""The HTTP layer every service gets from create_app: problems, idempotency, limits, correlation, health."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from sqlalchemy import text

from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.kit.errors import Conflict
from gpuaas.kit.testing import build, new_service_db, running

pytestmark = pytest.mark.integration


class ThingCreate(BaseModel):
    name: str = Field(min_length=1, max_length=20)


def things_router() -> APIRouter:
    router = APIRouter()

    @router.post("/things", status_code=201)
    async def create(request: Request, body: ThingCreate, principal: CurrentPrincipal) -> dict:
        await asyncio.sleep(0.2)  # long enough for a concurrent duplicate to arrive
        async with request.app.state.kit.sessions() as s, s.begin():
            if body.name == "taken":
                raise Conflict("that name is taken", code="thing_name_taken")
            thing_id = uuid.uuid4()
            await s.execute(text("INSERT INTO things (id, name) VALUES (:i, :n)"), {"i": thing_id, "n": body.name})
        return {"id": str(thing_id), "name": body.name}

    return router


@pytest.fixture
async def app_client(infra, signer):
    name, url = await new_service_db(infra.admin_url, "http")
    app = build(
        name,
        url,
        infra.kafka_bootstrap,
        with_iam=False,
        routers=[things_router()],
        settings={"max_request_bytes": 2000},
    )
    async with running(app, jwks=signer.jwks) as (client, kit):
        async with kit.sessions() as s, s.begin():
            await s.execute(text("CREATE TABLE things (id uuid primary key, name text)"))
        yield client, kit


async def count_things(kit) -> int:
    async with kit.sessions() as s:
        return (await s.execute(text("SELECT count(*) FROM things"))).scalar_one()


async def test_idempotency_key_replays_the_first_response(app_client, signer) -> None:
    client, kit = app_client
    h = {"Authorization": f"Bearer {signer.token(uuid.uuid4())}", "Idempotency-Key": "k-1"}
    first = await client.post("/things", json={"name": "a"}, headers=h)
    again = await client.post("/things", json={"name": "a"}, headers=h)
    assert first.status_code == 201 and again.status_code == 201
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    assert await count_things(kit) == 1
    other = await client.post("/things", json={"name": "b"}, headers=h)
    assert other.status_code == 422 and other.json()["code"] == "idempotency_key_reused"
    # Keys are per caller: someone else's identical key is a new request.
    h2 = {**h, "Authorization": f"Bearer {signer.token(uuid.uuid4())}"}
    assert (await client.post("/things", json={"name": "a"}, headers=h2)).status_code == 201
    assert await count_things(kit) == 2


async def test_concurrent_duplicates_never_run_twice(app_client, signer) -> None:
    client, kit = app_client
    h = {"Authorization": f"Bearer {signer.token(uuid.uuid4())}", "Idempotency-Key": "k-concurrent"}
    results = await asyncio.gather(*[client.post("/things", json={"name": "c"}, headers=h) for _ in range(5)])
    codes = sorted(r.status_code for r in results)
    assert codes.count(201) >= 1 and set(codes) <= {201, 409}
    assert await count_things(kit) == 1


async def test_reservation_of_a_killed_request_is_taken_over_when_stale(app_client, signer) -> None:
    client, kit = app_client
    user = uuid.uuid4()
    h = {"Authorization": f"Bearer {signer.token(user)}"}
    # What a process SIGKILLed mid-request leaves: a reservation with no response (same request hash).
    first = await client.post("/things", json={"name": "k"}, headers={**h, "Idempotency-Key": "probe"})
    assert first.status_code == 201
    async with kit.sessions() as s, s.begin():
        await s.execute(
            text(
                "INSERT INTO idempotency_keys (principal, key, method, path, request_hash, created_at) "
                "SELECT principal, k, method, path, request_hash, now() - make_interval(secs => age) "
                "FROM idempotency_keys, (VALUES ('fresh', 5), ('stale', 120)) v(k, age) "
                "WHERE principal = :p AND key = 'probe'"
            ),
            {"p": str(user)},
        )
    fresh = await client.post("/things", json={"name": "k"}, headers={**h, "Idempotency-Key": "fresh"})
    assert fresh.status_code == 409 and fresh.json()["code"] == "idempotency_request_in_progress"
    stale = await client.post("/things", json={"name": "k"}, headers={**h, "Idempotency-Key": "stale"})
    assert stale.status_code == 201, stale.text
    again = await client.post("/things", json={"name": "k"}, headers={**h, "Idempotency-Key": "stale"})
    assert again.headers["idempotent-replayed"] == "true" and again.json() == stale.json()
    assert await count_things(kit) == 2


async def test_a_request_whose_effect_committed_is_never_run_again(app_client, signer) -> None:
    """The process dies after the request's transaction committed but before its response was stored: the
    key's committed_at (written by that same transaction) makes every retry, however late, a 409
    `idempotency_request_committed` instead of a second effect."""
    client, kit = app_client
    user = uuid.uuid4()
    h = {"Authorization": f"Bearer {signer.token(user)}", "Idempotency-Key": "dies-after-commit"}
    first = await client.post("/things", json={"name": "once"}, headers=h)
    assert first.status_code == 201
    async with kit.sessions() as s:
        row = (
            await s.execute(
                text("SELECT committed_at IS NOT NULL FROM idempotency_keys WHERE principal = :p AND key = :k"),
                {"p": str(user), "k": "dies-after-commit"},
            )
        ).one()
    assert row[0], "the request's own transaction marked the key committed"
    # What a SIGKILL between the commit and storing the response leaves, an hour later (past the takeover):
    async with kit.sessions() as s, s.begin():
        await s.execute(
            text(
                "UPDATE idempotency_keys SET status_code = NULL, response_body = NULL, "
                "created_at = now() - interval '1 hour' WHERE principal = :p AND key = :k"
            ),
            {"p": str(user), "k": "dies-after-commit"},
        )
    retry = await client.post("/things", json={"name": "once"}, headers=h)
    assert retry.status_code == 409 and retry.json()["code"] == "idempotency_request_committed", retry.text
    assert await count_things(kit) == 1
    # A request that only read (refused before writing) leaves no marker: its stale reservation is taken over.
    h2 = {**h, "Idempotency-Key": "refused-then-died"}
    refused = await client.post("/things", json={"name": "taken"}, headers=h2)
    assert refused.status_code == 409
    async with kit.sessions() as s:
        marked = (
            await s.execute(
                text("SELECT committed_at FROM idempotency_keys WHERE principal = :p AND key = :k"),
                {"p": str(user), "k": "refused-then-died"},
            )
        ).scalar_one()
    assert marked is None


async def test_errors_are_problem_json_with_stable_codes(app_client, signer) -> None:
    client, kit = app_client
    auth = {"Authorization": f"Bearer {signer.token(uuid.uuid4())}"}
    r = await client.post("/things", json={"name": ""}, headers=auth)
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json"
    assert r.json()["code"] == "validation_error" and r.json()["errors"][0]["loc"][-1] == "name"
    r = await client.post("/things", json={"name": "taken"}, headers=auth)
    assert r.status_code == 409 and r.json()["code"] == "thing_name_taken"
    r = await client.post("/things", json={"name": "x"})
    assert r.status_code == 401 and r.json()["code"] == "missing_token"
    r = await client.post("/things", json={"name": "x"}, headers={"Authorization": "Bearer abc.def.ghi"})
    assert r.status_code == 401 and r.json()["code"] == "invalid_token"
    expired = signer.token(uuid.uuid4(), ttl_s=-120)
    r = await client.post("/things", json={"name": "x"}, headers={"Authorization": f"Bearer {expired}"})
    assert r.status_code == 401
    r = await client.post("/things", content=b"x" * 5000, headers={**auth, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["code"] == "payload_too_large"

    async def chunked():  # no Content-Length: the limit holds on the stream
        yield b'{"name": "'
        for _ in range(5):
            yield b"x" * 1000
        yield b'"}'

    r = await client.post("/things", content=chunked(), headers={**auth, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["code"] == "payload_too_large"
    assert await count_things(kit) == 0
    # A value Postgres cannot store (NUL byte) is bad input, not "database unavailable", and writes nothing.
    r = await client.post("/things", json={"name": "a\u0000b"}, headers=auth)
    assert r.status_code == 422 and r.json()["code"] == "invalid_value", r.text
    assert await count_things(kit) == 0
    r = await client.get("/nope")
    assert r.status_code == 404 and r.json()["code"] == "not_found"


async def test_correlation_id_is_echoed_or_created(app_client) -> None:
    client, _ = app_client
    r = await client.get("/healthz", headers={"X-Correlation-ID": "abc-123"})
    assert r.headers["x-correlation-id"] == "abc-123"
    r = await client.get("/healthz", headers={"X-Correlation-ID": "bad value with spaces"})
    assert r.headers["x-correlation-id"] != "bad value with spaces" and len(r.headers["x-correlation-id"]) == 32


async def test_health_readiness_and_metrics(app_client) -> None:
    client, _ = app_client
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"]["database"] and ready.json()["checks"]["broker"]
    metrics = (await client.get("/metrics")).text
    assert "gpuaas_http_request_duration_seconds_bucket{" in metrics and "gpuaas_dead_letters{" in metrics
    assert "gpuaas_outbox_pending_events{" in metrics and "gpuaas_outbox_lag_seconds{" in metrics


async def test_chunked_body_over_the_limit_is_413_not_a_read_error(app_client, signer) -> None:
    client, kit = app_client

    async def chunks():
        for _ in range(5):
            yield b"x" * 1000

    auth = {"Authorization": f"Bearer {signer.token(uuid.uuid4())}", "content-type": "application/json"}
    r = await client.post("/things", content=chunks(), headers=auth)
    assert r.status_code == 413 and r.json()["code"] == "payload_too_large"

    async def small():
        yield b'{"name": '
        yield b'"chunked"}'

    r = await client.post("/things", content=small(), headers=auth)
    assert r.status_code == 201 and r.json()["name"] == "chunked"
    assert await count_things(kit) == 1
