"""Catalog through the gateway, with the whole suite as processes and a real OCI registry:
trust (wrong digest, tag, tampered content refused), promotion gates, manifests with honest labels,
entitlements deciding a tenant's catalog, compatibility, the retire gate fed by app-runtime's
events (committed through app-runtime's own outbox and relay), and the seed apps."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from gpuaas.catalog.oci import ACCEPT, RegistryClient
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events import app_runtime as ar
from gpuaas.devstack.registry import LocalRegistry, RegistryMissing
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually, until_answered
from gpuaas.kit.db import create_engine, session_factory
from gpuaas.kit.outbox import add_event

pytestmark = pytest.mark.e2e
API = "/api/catalog"


@pytest.fixture(scope="module")
def registry() -> Iterator[LocalRegistry]:
    try:
        reg = LocalRegistry(Path(tempfile.mkdtemp(prefix="gpuaas-e2e-registry-"))).start()
    except RegistryMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    yield reg
    reg.stop()


async def _tenant_user(gw: httpx.AsyncClient, stack: Stack) -> tuple[str, dict[str, str]]:
    run = uuid.uuid4().hex[:8]
    t = await gw.post("/api/identity/tenants", json={"slug": f"cat-{run}", "name": f"Catalog {run}"})
    assert t.status_code == 201, t.text
    tenant_id = t.json()["tenant_id"]
    email, password = f"viewer-{run}@example.com", "correct-horse-battery"
    u = await gw.post(
        f"/api/identity/tenants/{tenant_id}/users", json={"email": email, "password": password, "role": "viewer"}
    )
    assert u.status_code == 201, u.text
    tok = await gw.post(
        "/api/identity/auth/token", data={"grant_type": "password", "username": email, "password": password}
    )
    assert tok.status_code == 200, tok.text
    viewer = {"Authorization": f"Bearer {tok.json()['access_token']}"}
    await until_answered(gw, f"{API}/apps", params={"tenant_id": tenant_id}, headers=viewer)  # membership in catalog
    return tenant_id, viewer


async def _emit_instance(stack: Stack, event: ar.InstanceCreated) -> None:
    engine = create_engine(stack.database_url("app_runtime"), "app_runtime", pool_size=1)
    try:
        async with session_factory(engine)() as s, s.begin():
            await add_event(s, event)
    finally:
        await engine.dispose()


async def test_catalog_through_the_gateway(stack: Stack, gw: httpx.AsyncClient, registry: LocalRegistry) -> None:
    oci = RegistryClient(["127.0.0.1"])
    tenant_id, viewer = await _tenant_user(gw, stack)

    # Trust: a tag, an unknown digest and tampered content are refused; a verified digest is registered.
    img = await oci.push_image(registry.address, "e2e/app", {"README": uuid.uuid4().bytes}, tag="v1")
    r = await gw.post(f"{API}/artifacts", json={"ref": f"{registry.address}/e2e/app:v1"})
    assert r.status_code == 422 and r.json()["code"] == "artifact_ref_not_pinned"
    r = await gw.post(f"{API}/artifacts", json={"ref": f"{registry.address}/e2e/app@sha256:{'1' * 64}"})
    assert r.status_code == 422 and r.json()["code"] == "artifact_manifest_unknown"
    bad = await oci.push_image(registry.address, "e2e/bad", {"README": uuid.uuid4().bytes}, tag="v1")
    async with httpx.AsyncClient(base_url=registry.url) as h:
        layer = (await h.get(f"/v2/e2e/bad/manifests/{bad.digest}", headers={"Accept": ACCEPT})).json()["layers"][0]
    registry.blob_file(layer["digest"]).write_bytes(b"tampered")
    r = await gw.post(f"{API}/artifacts", json={"ref": bad.ref})
    assert r.status_code == 422 and r.json()["code"] == "artifact_content_tampered"
    r = await gw.post(f"{API}/artifacts", json={"ref": img.ref})
    assert r.status_code == 201, r.text
    aid = r.json()["artifact_id"]
    r = await gw.post(f"{API}/artifacts", json={"ref": img.ref}, headers=viewer)
    assert r.status_code == 403

    # Gates.
    r = await gw.post(f"{API}/artifacts/{aid}/transitions", json={"to": "staged", "reason": "ship"})
    assert r.status_code == 409 and r.json()["code"] == "artifact_checks_missing"
    for name in ("lint", "smoke"):
        r = await gw.post(f"{API}/artifacts/{aid}/checks", json={"name": name, "passed": True, "detail": "ci"})
        assert r.status_code == 200
    await eventually(lambda: _tenant_known(stack, tenant_id), 30, "catalog projected the new tenant")
    for to in ("staged", "canary", "active"):
        r = await gw.post(
            f"{API}/artifacts/{aid}/transitions", json={"to": to, "reason": "e2e", "canary_tenants": [tenant_id]}
        )
        assert r.status_code == 200, r.text

    slug = f"e2e-{uuid.uuid4().hex[:6]}"
    m = await gw.post(
        f"{API}/apps",
        json={
            "slug": slug,
            "display_name": "E2E Slurm",
            "version": "1.0.0",
            "runtime_version": "Slurm 22.05",
            "artifact_kind": "controller",
            "artifact_ref": img.ref,
            "active": True,
            "roles": [{"key": "controller"}, {"key": "worker"}],
            "compatibility": {"multi_allocation": True},
        },
    )
    assert m.status_code == 201, m.text
    manifest = m.json()
    assert (manifest["version"], manifest["runtime_version"]) == ("1.0.0", "Slurm 22.05")

    r = await gw.get(f"{API}/apps", params={"tenant_id": tenant_id}, headers=viewer)
    assert r.status_code == 200 and slug not in {a["slug"] for a in r.json()}
    r = await gw.post(f"{API}/entitlements", json={"tenant_id": tenant_id, "app_slug": slug})
    assert r.status_code == 201, r.text
    r = await gw.get(f"{API}/apps", params={"tenant_id": tenant_id}, headers=viewer)
    assert slug in {a["slug"] for a in r.json()}
    r = await gw.post(
        f"{API}/apps/{slug}/compatibility",
        headers=viewer,
        json={"tenant_id": tenant_id, "capacity_shape": "gpu_slice", "gpu_count": 0, "allocation_count": 2},
    )
    assert r.status_code == 200 and [x["code"] for x in r.json()["reasons"]] == ["insufficient_gpus"]

    # Retire gate, fed by app-runtime's events through the broker.
    instance = uuid.uuid4()

    def inst(status: InstanceStatus, version: int, cls: type) -> ar.InstanceCreated:
        return cls.build(
            source="app-runtime",
            data=ar.InstanceState(
                instance_id=instance,
                tenant_id=uuid.UUID(tenant_id),
                project_id=uuid.uuid4(),
                app_slug=slug,
                app_version="1.0.0",
                manifest_id=uuid.UUID(manifest["manifest_id"]),
                artifact_digest=img.digest,
                status=status,
                status_changed_at=datetime.now(UTC),
                version=version,
            ),
        )

    await _emit_instance(stack, inst(InstanceStatus.running, 1, ar.InstanceRunning))
    await eventually(lambda: _projected(stack, instance, "running"), 60, "instance digest projected by catalog")
    r = await gw.post(f"{API}/artifacts/{aid}/transitions", json={"to": "deprecated", "reason": "superseded"})
    assert r.status_code == 200
    r = await gw.get(f"{API}/manifests/{manifest['manifest_id']}")
    assert r.json()["deprecated"] is True
    r = await gw.post(f"{API}/artifacts/{aid}/transitions", json={"to": "retired", "reason": "eol"})
    assert r.status_code == 409 and r.json()["code"] == "artifact_in_use"
    await _emit_instance(stack, inst(InstanceStatus.decommissioned, 2, ar.InstanceDecommissioned))
    await eventually(lambda: _projected(stack, instance, "decommissioned"), 60, "decommission projected")
    r = await gw.post(f"{API}/artifacts/{aid}/transitions", json={"to": "retired", "reason": "eol"})
    assert r.status_code == 200 and r.json()["state"] == "retired"

    # The audit store (identity) received the catalog's records.
    async def audited() -> bool:
        r = await gw.get("/api/identity/audit", params={"resource_id": aid})
        return r.status_code == 200 and r.json()["total"] >= 7

    await eventually(audited, 60, "catalog audit records stored by identity")

    # Seed apps.
    r = await gw.post(f"{API}/admin/seed", json={"registry": registry.address, "tenant_ids": [tenant_id]})
    assert r.status_code == 200, r.text
    r = await gw.get(f"{API}/apps", params={"tenant_id": tenant_id}, headers=viewer)
    labels = {a["slug"]: a["runtime_version"] for a in r.json()}
    assert labels["slurm-reference"] == "Slurm 22.05" and labels["vllm"] == "vLLM 0.6.3"
    assert {"jupyter", "rke2-self-managed"} <= set(labels)


async def _tenant_known(stack: Stack, tenant_id: str) -> bool:
    return bool(await stack.fetchval("catalog", "SELECT 1 FROM iam_tenants WHERE tenant_id = $1", uuid.UUID(tenant_id)))


async def _projected(stack: Stack, instance: uuid.UUID, status: str) -> bool:
    got = await stack.fetchval("catalog", "SELECT status FROM instance_digests WHERE instance_id = $1", instance)
    return got == status
