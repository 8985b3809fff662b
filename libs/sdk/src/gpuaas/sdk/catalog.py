"""Catalog: the apps a tenant may deploy (each version a manifest) and the artifacts they install."""

from __future__ import annotations

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
