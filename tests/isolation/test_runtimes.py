"""Runtime images as catalog artifacts, through the platform: a runtime whose registry content was tampered
with after it was promoted is refused when the agent pulls it by digest (the allocation fails with the
reason, nothing runs); a retired runtime cannot be chosen at create (422 `runtime_unavailable`), by slug,
slug@version or digest."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuaas.catalog.oci import ACCEPT, RegistryClient
from gpuaas.devstack.registry import LocalRegistry
from gpuaas.devstack.waiting import eventually

from .harness import A, Agent, Tenant, containers_of, in_thread, podman

pytestmark = pytest.mark.e2e
C = "/api/catalog"


@pytest.fixture(scope="module")
def registry() -> Iterator[LocalRegistry]:
    reg = LocalRegistry(Path(tempfile.mkdtemp(prefix="gpuaas-isolation-registry-"))).start()
    yield reg
    reg.stop()


async def publish_runtime(gw: httpx.AsyncClient, registry: LocalRegistry, tenant_id: str) -> dict[str, Any]:
    """A one-layer image pushed as runtimes/<slug>:1.0.0, registered (trust checks), promoted to active
    and offered as a `runtime` app to the tenant; its slug, ref and digest."""
    slug = f"iso-rt-{uuid.uuid4().hex[:6]}"
    img = await RegistryClient(["127.0.0.1"]).push_image(
        registry.address, f"runtimes/{slug}", {"etc/iso-runtime": uuid.uuid4().bytes * 4096}, tag="1.0.0"
    )
    r = await gw.post(f"{C}/artifacts", json={"ref": img.ref})
    assert r.status_code == 201, r.text
    artifact_id = r.json()["artifact_id"]
    for name in ("lint", "smoke"):
        r = await gw.post(f"{C}/artifacts/{artifact_id}/checks", json={"name": name, "passed": True, "detail": "t"})
        assert r.status_code == 200, r.text
    for to in ("staged", "canary", "active"):
        body = {"to": to, "reason": "isolation test", "canary_tenants": [tenant_id]}

        async def moved(body: dict[str, Any] = body) -> httpx.Response | None:  # the tenant reaches catalog by event
            r = await gw.post(f"{C}/artifacts/{artifact_id}/transitions", json=body)
            return None if r.status_code == 422 and r.json()["code"] == "tenant_unknown" else r

        r = await eventually(moved, 60, f"transition to {to}", interval_s=0.3)
        assert r.status_code == 200, r.text
    manifest = {
        "slug": slug,
        "display_name": f"Isolation runtime {slug}",
        "version": "1.0.0",
        "artifact_kind": "runtime",
        "artifact_ref": img.ref,
        "active": True,
    }
    r = await gw.post(f"{C}/apps", json=manifest)
    assert r.status_code == 201, r.text
    r = await gw.post(f"{C}/entitlements", json={"tenant_id": tenant_id, "app_slug": slug})
    assert r.status_code in (201, 409), r.text
    return {"slug": slug, "ref": img.ref, "digest": img.digest, "artifact_id": artifact_id}


async def create_status(tenant: Tenant, **body: Any) -> tuple[int, dict[str, Any]]:
    r = await tenant.client.post(f"{A}/projects/{tenant.project_id}/allocations", json=body)
    return r.status_code, r.json()


async def test_tampered_runtime_is_refused_at_pull(
    host: Agent, tenants: tuple[Tenant, Tenant], gw: httpx.AsyncClient, registry: LocalRegistry
) -> None:
    owner, _ = tenants
    rt = await publish_runtime(gw, registry, owner.team.tenant_id)
    # After promotion, the registry's copy of the layer changes (same size: only the content lies).
    async with httpx.AsyncClient(base_url=registry.url) as h:
        repo = rt["ref"].split("/", 1)[1].split("@")[0]
        manifest = (await h.get(f"/v2/{repo}/manifests/{rt['digest']}", headers={"Accept": ACCEPT})).json()
    blob = registry.blob_file(manifest["layers"][0]["digest"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))

    async def created() -> dict[str, Any] | None:  # allocations' runtime projection catches up with the catalog
        status, body = await create_status(
            owner, gpu_model="H100-80GB", gpu_count=1, host_class=host.host_class, runtime=rt["slug"]
        )
        assert status in (201, 422), body
        return body if status == 201 else None

    alloc = await eventually(created, 60, "runtime selectable", interval_s=0.5)
    assert alloc["runtime"]["digest"] == rt["digest"]
    failed = await owner.wait(alloc["allocation_id"], "failed", timeout_s=180)
    reason = (failed["failure_reason"] or "").lower()
    assert "digest" in reason or "pull" in reason, failed["failure_reason"]
    assert await in_thread(containers_of, alloc["allocation_id"]) == []
    images = await in_thread(podman, "images", "--digests", "--format", "{{.Digest}}")
    assert rt["digest"] not in images.split(), "the tampered image is in the host's image store"


async def test_retired_runtime_cannot_be_chosen(
    tenants: tuple[Tenant, Tenant], gw: httpx.AsyncClient, registry: LocalRegistry
) -> None:
    owner, _ = tenants
    rt = await publish_runtime(gw, registry, owner.team.tenant_id)
    # No host has this GPU model: what is checked is only whether the runtime may be chosen.
    nowhere = {"gpu_model": f"ISO-NONE-{uuid.uuid4().hex[:4]}", "gpu_count": 1}
    refs = (rt["slug"], f"{rt['slug']}@1.0.0", rt["digest"])

    async def selectable() -> bool:
        status, body = await create_status(owner, **nowhere, runtime=refs[1])
        if status == 201:
            await owner.client.post(f"{A}/allocations/{body['allocation_id']}/release")
        return body.get("code") != "runtime_unavailable"

    await eventually(selectable, 60, "the active runtime selectable", interval_s=0.5)
    for to in ("deprecated", "retired"):
        r = await gw.post(f"{C}/artifacts/{rt['artifact_id']}/transitions", json={"to": to, "reason": "eol"})
        assert r.status_code == 200, r.text

    async def refused() -> bool:
        for ref in refs:
            status, body = await create_status(owner, **nowhere, runtime=ref)
            if not (status == 422 and body.get("code") == "runtime_unavailable"):
                return False
        return True

    await eventually(refused, 60, "the retired runtime refused by slug, slug@version and digest", interval_s=0.5)
