"""Catalog: the apps a tenant may deploy (each version a manifest) and the artifacts they install; and the
publishing calls (operators / publishers): register an artifact pinned by digest, record its checks, promote
it through the gates, register and activate a manifest, grant a tenant the app."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuaas.sdk.models import Artifact, Manifest
from gpuaas.sdk.transport import Id, Transport, query

CATALOG = "/api/catalog"


class CatalogApi(Transport):
    async def apps(self, *, tenant_id: Id | None = None, slug: str | None = None) -> list[Manifest]:
        """The app versions offered to the tenant (operators without `tenant_id`: every manifest)."""
        data = await self.request("GET", f"{CATALOG}/apps", params=query({"tenant_id": tenant_id, "slug": slug}))
        return [Manifest.model_validate(m) for m in data]

    async def app_versions(self, slug: str) -> list[Manifest]:
        return [Manifest.model_validate(m) for m in await self.request("GET", f"{CATALOG}/apps/{slug}")]

    async def manifest(self, manifest_id: Id) -> Manifest:
        return Manifest.model_validate(await self.request("GET", f"{CATALOG}/manifests/{manifest_id}"))

    async def artifact(self, artifact_id: Id) -> Artifact:
        return Artifact.model_validate(await self.request("GET", f"{CATALOG}/artifacts/{artifact_id}"))

    # --- publishing ---

    async def register_artifact(self, ref: str) -> Artifact:
        """`ref` pinned by digest (`registry/repo@sha256:...`): the catalog fetches and verifies it."""
        return Artifact.model_validate(await self.request("POST", f"{CATALOG}/artifacts", json={"ref": ref}))

    async def record_check(self, artifact_id: Id, name: str, *, passed: bool, detail: str = "") -> Artifact:
        """A promotion gate's evidence (e.g. `lint`, `smoke`): every required check must pass before staging."""
        body = {"name": name, "passed": passed, "detail": detail}
        return Artifact.model_validate(
            await self.request("POST", f"{CATALOG}/artifacts/{artifact_id}/checks", json=body)
        )

    async def promote(self, artifact_id: Id, to: str, reason: str, *, canary_tenants: Sequence[Id] = ()) -> Artifact:
        """One gate: `staged` → `canary` (to `canary_tenants`) → `active`; later `deprecated`, `retired`."""
        body = {"to": to, "reason": reason, "canary_tenants": [str(t) for t in canary_tenants]}
        data = await self.request("POST", f"{CATALOG}/artifacts/{artifact_id}/transitions", json=body)
        return Artifact.model_validate(data)

    async def register_app(self, manifest: dict[str, Any]) -> Manifest:
        """A manifest (slug, version, `artifact_kind`, `artifact_ref` of a registered artifact, `roles`,
        `inputs` JSON Schema, compatibility); `GET /api/catalog/schemas/manifest` is its schema."""
        return Manifest.model_validate(await self.request("POST", f"{CATALOG}/apps", json=manifest))

    async def activate_manifest(self, manifest_id: Id) -> Manifest:
        return Manifest.model_validate(await self.request("POST", f"{CATALOG}/manifests/{manifest_id}/activate"))

    async def grant_entitlement(self, tenant_id: Id, app_slug: str) -> dict[str, Any]:
        """Let a tenant see and deploy the app (operators)."""
        body = {"tenant_id": str(tenant_id), "app_slug": app_slug}
        data: dict[str, Any] = await self.request("POST", f"{CATALOG}/entitlements", json=body)
        return data
