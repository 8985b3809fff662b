"""Catalog test fixtures: a real OCI registry on loopback, the catalog app on a fresh schema, and an
IAM projection seeded with identity events (operator, two tenants, their users)."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuaas.catalog.app import SPEC
from gpuaas.catalog.oci import RegistryClient
from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.events import identity as ev
from gpuaas.devstack.registry import LocalRegistry, RegistryMissing
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.iam import apply_locally
from gpuaas.kit.testing import running, service_app


@pytest.fixture(scope="session")
def registry() -> Iterator[LocalRegistry]:
    root = Path(tempfile.mkdtemp(prefix="gpuaas-registry-"))
    try:
        reg = LocalRegistry(root).start()
    except RegistryMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    yield reg
    reg.stop()


@pytest.fixture(scope="session")
def oci() -> RegistryClient:
    return RegistryClient(["127.0.0.1"], timeout_s=10)


@dataclass
class World:
    client: httpx.AsyncClient
    kit: KitRuntime
    signer: Any
    operator: uuid.UUID
    t1: uuid.UUID
    t2: uuid.UUID
    p1: uuid.UUID
    t1_admin: uuid.UUID
    t1_member: uuid.UUID
    t2_admin: uuid.UUID

    def headers(self, user: uuid.UUID, **claims: Any) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.signer.token(user, **claims)}"}

    @property
    def op(self) -> dict[str, str]:
        return self.headers(self.operator)

    async def new_tenant(self, admin: uuid.UUID | None = None) -> uuid.UUID:
        tenant = uuid.uuid4()
        events: list[ev.Event] = [
            ev.TenantCreated.build(
                source="identity", data=ev.TenantState(tenant_id=tenant, slug=f"t-{tenant.hex[:8]}", name="T")
            )
        ]
        if admin is not None:
            events.append(membership(admin, Role.tenant_admin, tenant))
        async with self.kit.sessions() as s, s.begin():
            for e in events:
                await apply_locally(s, e)
        return tenant


def membership(user: uuid.UUID, role: Role, tenant: uuid.UUID | None, project: uuid.UUID | None = None) -> ev.Event:
    scope = MembershipScope.project if project else MembershipScope.tenant if tenant else MembershipScope.platform
    m = ev.MembershipState(
        membership_id=uuid.uuid4(), user_id=user, scope=scope, role=role, tenant_id=tenant, project_id=project
    )
    return ev.MembershipGranted.build(data=m, source="identity")


@pytest.fixture(scope="module")
async def world(infra, signer) -> AsyncIterator[World]:
    app = await service_app(SPEC, infra.admin_url, infra.kafka_bootstrap)
    async with running(app, jwks=signer.jwks) as (client, kit):
        ids = {k: uuid.uuid4() for k in ("operator", "t1", "t2", "p1", "t1_admin", "t1_member", "t2_admin")}
        events = [
            membership(ids["operator"], Role.platform_admin, None),
            ev.TenantCreated.build(source="identity", data=ev.TenantState(tenant_id=ids["t1"], slug="t1", name="T1")),
            ev.TenantCreated.build(source="identity", data=ev.TenantState(tenant_id=ids["t2"], slug="t2", name="T2")),
            ev.ProjectCreated.build(
                source="identity", data=ev.ProjectState(project_id=ids["p1"], tenant_id=ids["t1"], name="p1")
            ),
            membership(ids["t1_admin"], Role.tenant_admin, ids["t1"]),
            membership(ids["t1_member"], Role.project_member, ids["t1"], ids["p1"]),
            membership(ids["t2_admin"], Role.tenant_admin, ids["t2"]),
        ]
        async with kit.sessions() as s, s.begin():
            for e in events:
                await apply_locally(s, e)
        yield World(client=client, kit=kit, signer=signer, **ids)


class Flows:
    """Common request sequences (each asserts its own status codes)."""

    def __init__(self, world: World, registry: LocalRegistry, oci: RegistryClient) -> None:
        self.w, self.registry, self.oci = world, registry, oci

    async def image(self, repo: str | None = None, content: bytes | None = None) -> Any:
        repo = repo or f"apps/img-{uuid.uuid4().hex[:10]}"
        return await self.oci.push_image(
            self.registry.address, repo, {"app/README": content or uuid.uuid4().bytes}, tag="v1"
        )

    async def register(self, ref: str, kind: str = "oci", **extra: Any) -> dict[str, Any]:
        r = await self.w.client.post("/artifacts", json={"ref": ref, "kind": kind, **extra}, headers=self.w.op)
        assert r.status_code == 201, r.text
        return r.json()

    async def check(self, artifact_id: str, name: str, passed: bool = True) -> httpx.Response:
        r = await self.w.client.post(
            f"/artifacts/{artifact_id}/checks", json={"name": name, "passed": passed, "detail": "ci"}, headers=self.w.op
        )
        assert r.status_code == 200, r.text
        return r

    async def move(self, artifact_id: str, to: str, **extra: Any) -> httpx.Response:
        return await self.w.client.post(
            f"/artifacts/{artifact_id}/transitions", json={"to": to, "reason": f"to {to}", **extra}, headers=self.w.op
        )

    async def to_active(self, artifact_id: str, tenants: list[uuid.UUID]) -> dict[str, Any]:
        await self.check(artifact_id, "lint")
        await self.check(artifact_id, "smoke")
        for to in ("staged", "canary", "active"):
            r = await self.move(artifact_id, to, canary_tenants=[str(t) for t in tenants])
            assert r.status_code == 200, r.text
        return r.json()

    async def active_app(
        self, slug: str, tenants: list[uuid.UUID], kind: str = "oci", **manifest: Any
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        ref = await self.image()
        art = await self.register(ref.ref)
        await self.to_active(art["artifact_id"], tenants)
        body = {
            "slug": slug,
            "display_name": slug.title(),
            "version": "1.0.0",
            "artifact_kind": kind,
            "artifact_ref": ref.ref,
            "active": True,
            **manifest,
        }
        r = await self.w.client.post("/apps", json=body, headers=self.w.op)
        assert r.status_code == 201, r.text
        return art, r.json()

    async def entitle(self, tenant: uuid.UUID, slug: str) -> dict[str, Any]:
        r = await self.w.client.post(
            "/entitlements", json={"tenant_id": str(tenant), "app_slug": slug}, headers=self.w.op
        )
        assert r.status_code == 201, r.text
        return r.json()


@pytest.fixture
def flows(world: World, registry: LocalRegistry, oci: RegistryClient) -> Flows:
    return Flows(world, registry, oci)
