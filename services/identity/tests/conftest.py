"""One identity app per test module (real Postgres schema, real broker); each test makes its own tenant."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gpuaas.identity.app import SPEC
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.testing import running, service_app

ISSUER = "http://test-issuer/api/identity"
ADMIN_EMAIL = "op@platform.test"
ADMIN_PASSWORD = "operator-password-1"
PASSWORD = "correct horse battery"


@dataclass
class Identity:
    client: httpx.AsyncClient
    kit: KitRuntime

    async def login(self, email: str, password: str = PASSWORD, **headers: str) -> dict[str, Any]:
        r = await self.client.post(
            "/auth/token", data={"grant_type": "password", "username": email, "password": password}, headers=headers
        )
        assert r.status_code == 200, r.text
        return r.json()

    async def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {(await self.login(ADMIN_EMAIL, ADMIN_PASSWORD))['access_token']}"}

    async def tenant(self) -> dict[str, Any]:
        """A fresh tenant with a project, a tenant admin and a project member (their auth headers)."""
        admin = await self.admin()
        slug = f"t-{uuid.uuid4().hex[:8]}"
        t = await self.client.post("/tenants", json={"slug": slug, "name": slug}, headers=admin)
        assert t.status_code == 201, t.text
        tid = t.json()["tenant_id"]
        p = await self.client.post(f"/tenants/{tid}/projects", json={"name": "main"}, headers=admin)
        assert p.status_code == 201, p.text
        out: dict[str, Any] = {"tenant_id": tid, "slug": slug, "project_id": p.json()["project_id"], "op": admin}
        for role in ("tenant_admin", "project_member"):
            email = f"{role}-{slug}@{slug}.example"
            body = {"email": email, "password": PASSWORD, "role": role if role == "tenant_admin" else None}
            u = await self.client.post(f"/tenants/{tid}/users", json=body, headers=admin)
            assert u.status_code == 201, u.text
            out[f"{role}_id"], out[f"{role}_email"] = u.json()["user_id"], email
            if role == "project_member":
                m = await self.client.post(
                    f"/projects/{out['project_id']}/members",
                    json={"user_id": u.json()["user_id"], "role": role},
                    headers=admin,
                )
                assert m.status_code == 201, m.text
                out["member_membership_id"] = m.json()["membership_id"]
            out[role] = {"Authorization": f"Bearer {(await self.login(email))['access_token']}"}
        return out


@pytest.fixture(scope="module")
async def identity(infra) -> AsyncIterator[Identity]:
    app = await service_app(
        SPEC,
        infra.admin_url,
        infra.kafka_bootstrap,
        public_url=ISSUER,
        bootstrap_admin_email=ADMIN_EMAIL,
        bootstrap_admin_password=ADMIN_PASSWORD,
        lockout_threshold=3,
        lockout_s=60,
        source_threshold=1000,
        access_token_ttl_s=120,
    )
    async with running(app) as (client, kit):
        kit.verifier.jwks.set((await client.get("/.well-known/jwks.json")).json())
        yield Identity(client, kit)
