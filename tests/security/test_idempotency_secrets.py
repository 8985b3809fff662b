"""Issue 28, black-box through the gateway: replaying a host enrolment's Idempotency-Key returned the same
node token (stored in clear in allocations' idempotency store), and all anonymous POSTs shared one
idempotency scope. Now a replay answers the host with `node_token` null and `secret_not_shown_again`, the
token is nowhere in the store, and a key without credentials is refused (gpuaas.kit.idempotency).
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from gpuaas.devstack.stack import Stack


@pytest.mark.e2e
async def test_a_replayed_host_enrolment_shows_no_node_token(stack: Stack, gw: httpx.AsyncClient) -> None:
    key = f"enrol-{uuid.uuid4().hex}"
    body = {"name": f"sec-{uuid.uuid4().hex[:8]}"}
    first = await gw.post("/api/allocations/hosts", json=body, headers={"Idempotency-Key": key})
    assert first.status_code == 201, first.text
    token = first.json()["node_token"]
    assert token

    again = await gw.post("/api/allocations/hosts", json=body, headers={"Idempotency-Key": key})
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true", again.text
    assert token not in again.text
    assert again.json()["node_token"] is None and again.json()["secret_not_shown_again"] == ["node_token"]
    assert again.json()["host_id"] == first.json()["host_id"]  # the same host, not a second one

    engine = create_async_engine(stack.database_url("allocations"))
    try:
        async with engine.connect() as conn:
            stored = (
                await conn.execute(text("SELECT response_body FROM idempotency_keys WHERE key = :k"), {"k": key})
            ).scalar_one()
    finally:
        await engine.dispose()
    assert stored is not None and token.encode() not in bytes(stored)


@pytest.mark.e2e
async def test_an_anonymous_idempotency_key_is_refused(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        r = await c.post(
            "/api/identity/auth/token",
            data={"grant_type": "password", "username": "nobody@nowhere.example", "password": "x" * 12},
            headers={"Idempotency-Key": f"anon-{uuid.uuid4().hex}"},
        )
    assert r.status_code == 400 and r.json()["code"] == "idempotency_key_needs_credentials", r.text
