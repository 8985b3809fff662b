"""A revoked membership denies access in every service within seconds, through the gateway, while the
caller's access token is still valid (each service's `gpuaas.kit.iam` projection applies the event)."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx

from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually


def segment(service: str) -> str:
    return service.replace("_", "-")


async def statuses(client: httpx.AsyncClient, services: list[str], headers: dict[str, str]) -> dict[str, int]:
    async def one(svc: str) -> tuple[str, int]:
        r = await client.get(f"/api/{segment(svc)}/admin/outbox", headers=headers)
        return svc, r.status_code

    return dict(await asyncio.gather(*(one(s) for s in services)))


async def test_revoked_operator_is_denied_in_every_service(stack: Stack, gw: httpx.AsyncClient) -> None:
    email = f"op-{uuid.uuid4().hex[:6]}@platform.example.com"
    r = await gw.post("/api/identity/users", json={"email": email, "password": "second-operator-pw"})
    assert r.status_code == 201, r.text
    grant = await gw.post("/api/identity/platform-admins", json={"user_id": r.json()["user_id"]})
    assert grant.status_code == 201, grant.text
    login = await gw.post(
        "/api/identity/auth/token", data={"grant_type": "password", "username": email, "password": "second-operator-pw"}
    )
    auth = {"Authorization": f"Bearer {login.json()['access_token']}"}
    services = list(stack.services)
    assert len(services) >= 2

    async def all_allowed() -> dict[str, int] | None:
        s = await statuses(gw, services, auth)
        return s if set(s.values()) == {200} else None

    await eventually(all_allowed, 30, "the grant reaching every service's projection")

    await gw.delete(f"/api/identity/memberships/{grant.json()['membership_id']}")
    t0 = time.monotonic()

    async def all_denied() -> dict[str, int] | None:
        s = await statuses(gw, services, auth)
        return s if set(s.values()) == {403} else None

    denied = await eventually(all_denied, 10, "the revocation reaching every service", interval_s=0.05)
    elapsed = time.monotonic() - t0
    print(f"revocation denied in {len(denied)} services after {elapsed:.2f}s")
    assert elapsed < 10


async def test_revoked_project_member_loses_the_project(stack: Stack, gw: httpx.AsyncClient) -> None:
    slug = f"rv-{uuid.uuid4().hex[:6]}"
    tid = (await gw.post("/api/identity/tenants", json={"slug": slug, "name": slug})).json()["tenant_id"]
    pid = (await gw.post(f"/api/identity/tenants/{tid}/projects", json={"name": "p"})).json()["project_id"]
    email = f"m@{slug}.example.com"
    uid = (
        await gw.post(
            f"/api/identity/tenants/{tid}/users", json={"email": email, "password": "member-password-1", "role": None}
        )
    ).json()["user_id"]
    m = await gw.post(f"/api/identity/projects/{pid}/members", json={"user_id": uid, "role": "project_member"})
    token = (
        await gw.post(
            "/api/identity/auth/token",
            data={"grant_type": "password", "username": email, "password": "member-password-1"},
        )
    ).json()
    auth = {"Authorization": f"Bearer {token['access_token']}"}
    assert (await gw.get(f"/api/identity/projects/{pid}", headers=auth)).status_code == 200
    assert (await gw.delete(f"/api/identity/memberships/{m.json()['membership_id']}")).status_code == 204
    # Same token, immediately: no standing in the tenant any more -> 404 (existence not revealed).
    r = await gw.get(f"/api/identity/projects/{pid}", headers=auth)
    assert r.status_code == 404
