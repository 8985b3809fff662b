"""App manifests (JSON Schema validation, digest-only refs, honest version labels), entitlements and
what each tenant sees (active + canary exposure), compatibility with reasons, the seed apps."""

from __future__ import annotations

import uuid

import pytest

pytestmark = pytest.mark.integration


def manifest(ref: str, slug: str | None = None, **extra):
    return {
        "slug": slug or f"app-{uuid.uuid4().hex[:8]}",
        "display_name": "App",
        "version": "1.0.0",
        "artifact_kind": "oci",
        "artifact_ref": ref,
        **extra,
    }


async def test_manifest_validation_and_gates(world, flows) -> None:
    c, op = world.client, world.op
    img = await flows.image()
    art = await flows.register(img.ref)
    ref = img.ref

    async def post(body):
        return await c.post("/apps", json=body, headers=op)

    r = await post(manifest(f"{img.registry}/{img.repository}:v1"))
    assert r.status_code == 422 and r.json()["code"] == "artifact_ref_not_pinned"
    r = await post({**manifest(ref), "version": "latest"})
    assert r.status_code == 422 and r.json()["code"] == "manifest_invalid"
    assert any(e["path"] == "version" for e in r.json()["errors"])
    r = await post({k: v for k, v in manifest(ref).items() if k != "display_name"})
    assert r.status_code == 422 and r.json()["code"] == "manifest_invalid"
    r = await post({**manifest(ref), "surprise": 1})
    assert r.status_code == 422 and r.json()["code"] == "manifest_invalid"
    r = await post(manifest(ref, compatibility={"requires_capacity_shape": ["vm"]}))
    assert r.status_code == 422 and r.json()["errors"][0]["path"].startswith("compatibility")
    r = await post(manifest(ref, artifact_kind="launchable"))
    assert r.status_code == 422 and r.json()["code"] == "runtime_profile_required"
    r = await post(
        manifest(
            ref,
            artifact_kind="launchable",
            runtime_profile={"image": ref, "ports": [{"name": "http", "container_port": 70000}]},
        )
    )
    assert r.status_code == 422 and r.json()["code"] == "runtime_profile_invalid"
    assert r.json()["errors"][0]["path"] == "runtime_profile/ports/0/container_port"
    other = f"{img.registry}/{img.repository}@sha256:{'b' * 64}"
    r = await post(manifest(ref, artifact_kind="launchable", runtime_profile={"image": other}))
    assert r.status_code == 422 and r.json()["code"] == "runtime_profile_invalid"
    r = await post(
        manifest(ref, artifact_kind="launchable", runtime_profile={"image": ref, "resources": {"gpu_count": 4}})
    )
    assert r.status_code == 422 and r.json()["code"] == "runtime_profile_inconsistent"
    r = await post(
        manifest(ref, artifact_kind="controller", roles=[{"key": "controller"}], runtime_profile={"image": ref})
    )
    assert r.status_code == 422 and r.json()["code"] == "runtime_profile_not_applicable"
    r = await post(manifest(ref, inputs={"type": "object", "properties": {"n": {"type": "nope"}}}))
    assert r.status_code == 422 and r.json()["code"] == "inputs_schema_invalid"
    r = await post(manifest(ref, inputs={"type": "string"}))
    assert r.status_code == 422 and r.json()["code"] == "inputs_schema_invalid"
    r = await post(manifest(ref, artifact_kind="controller"))
    assert r.status_code == 422 and r.json()["code"] == "roles_required"
    r = await post(manifest(ref, artifact_kind="controller", roles=[{"key": "a"}, {"key": "a"}]))
    assert r.status_code == 422 and r.json()["code"] == "roles_invalid"
    r = await post(manifest(ref, artifact_kind="blob"))
    assert r.status_code == 422 and r.json()["code"] == "artifact_kind_mismatch"
    unknown = (await flows.image()).ref
    r = await post(manifest(unknown))
    assert r.status_code == 422 and r.json()["code"] == "artifact_not_registered"
    r = await post(manifest(ref, active=True))  # an active manifest cannot reference a draft artifact
    assert r.status_code == 409 and r.json()["code"] == "artifact_not_active"
    r = await c.post("/apps", json=manifest(ref), headers=world.headers(world.t1_admin))
    assert r.status_code == 403

    slug = f"slurm-{uuid.uuid4().hex[:6]}"
    good = manifest(
        ref,
        slug=slug,
        artifact_kind="controller",
        version="1.0.0",
        runtime_version="Slurm 22.05",
        roles=[{"key": "controller", "display_name": "Controller"}, {"key": "worker"}],
        compatibility={"multi_allocation": True},
        inputs={"type": "object", "properties": {"cluster_name": {"type": "string"}}, "required": ["cluster_name"]},
    )
    r = await post(good)
    assert r.status_code == 201, r.text
    m = r.json()
    assert (m["version"], m["runtime_version"]) == ("1.0.0", "Slurm 22.05")
    assert m["active"] is False and m["artifact_state"] == "draft" and m["artifact_id"] == art["artifact_id"]
    assert m["compatibility"] == {
        "requires_capacity_shape": ["baremetal", "gpu_slice"],
        "min_gpu_count": 1,
        "requires_exclusive_node": False,
        "multi_allocation": True,
    }
    r = await post(good)
    assert r.status_code == 409 and r.json()["code"] == "manifest_version_exists"
    r = await c.post(f"/manifests/{m['manifest_id']}/activate", headers=op)
    assert r.status_code == 409 and r.json()["code"] == "artifact_not_active"
    await flows.to_active(art["artifact_id"], [world.t1])
    r = await c.post(f"/manifests/{m['manifest_id']}/activate", headers={**op, "If-Match": '"7"'})
    assert r.status_code == 412
    r = await c.post(f"/manifests/{m['manifest_id']}/activate", headers=op)
    assert r.status_code == 200 and r.json()["active"] is True and r.json()["revision"] == 2
    schema = await c.get("/schemas/launchable-profile", headers=op)
    assert schema.status_code == 200 and "image" in schema.json()["required"]


async def test_entitlements_decide_what_a_tenant_lists(world, flows) -> None:
    c = world.client
    slug = f"jup-{uuid.uuid4().hex[:6]}"
    _, m = await flows.active_app(slug, [world.t1], runtime_version="JupyterLab 4.2")
    t1_member, t1_admin, t2_admin = (world.headers(u) for u in (world.t1_member, world.t1_admin, world.t2_admin))

    def slugs(r):
        assert r.status_code == 200, r.text
        return {a["slug"] for a in r.json()}

    assert slug not in slugs(await c.get("/apps", params={"tenant_id": str(world.t1)}, headers=t1_member))
    r = await c.post("/entitlements", json={"tenant_id": str(world.t1), "app_slug": slug}, headers=t1_admin)
    assert r.status_code == 403
    r = await c.post("/entitlements", json={"tenant_id": str(uuid.uuid4()), "app_slug": slug}, headers=world.op)
    assert r.status_code == 422 and r.json()["code"] == "tenant_unknown"
    r = await c.post("/entitlements", json={"tenant_id": str(world.t1), "app_slug": "no-such-app"}, headers=world.op)
    assert r.status_code == 404 and r.json()["code"] == "app_not_found"
    ent = await flows.entitle(world.t1, slug)
    r = await c.post("/entitlements", json={"tenant_id": str(world.t1), "app_slug": slug}, headers=world.op)
    assert r.status_code == 409 and r.json()["code"] == "already_entitled"

    assert slug in slugs(await c.get("/apps", params={"tenant_id": str(world.t1)}, headers=t1_member))
    # The tenant comes from the token when not given.
    assert slug in slugs(await c.get("/apps", headers=world.headers(world.t1_member, tenant_id=str(world.t1))))
    assert slug not in slugs(await c.get("/apps", params={"tenant_id": str(world.t2)}, headers=t2_admin))
    r = await c.get("/apps", params={"tenant_id": str(world.t1)}, headers=t2_admin)
    assert r.status_code == 404  # not their tenant: it does not exist for them
    r = await c.get("/apps", headers=t2_admin)
    assert r.status_code == 422 and r.json()["code"] == "tenant_required"
    r = await c.get(f"/manifests/{m['manifest_id']}", params={"tenant_id": str(world.t2)}, headers=t2_admin)
    assert r.status_code == 404
    r = await c.get("/entitlements", params={"tenant_id": str(world.t1)}, headers=t2_admin)
    assert r.status_code == 404
    mine = await c.get("/entitlements", params={"tenant_id": str(world.t1)}, headers=t1_member)
    assert slug in {e["app_slug"] for e in mine.json()}

    # Canary exposure: a new version whose artifact is in canary for t2 only.
    img = await flows.image()
    art2 = await flows.register(img.ref)
    await flows.check(art2["artifact_id"], "lint")
    await flows.check(art2["artifact_id"], "smoke")
    assert (await flows.move(art2["artifact_id"], "staged")).status_code == 200
    assert (await flows.move(art2["artifact_id"], "canary", canary_tenants=[str(world.t2)])).status_code == 200
    r = await c.post("/apps", json=manifest(img.ref, slug=slug, version="1.1.0"), headers=world.op)
    assert r.status_code == 201
    await flows.entitle(world.t2, slug)
    t1_versions = [
        a["version"]
        for a in (await c.get(f"/apps/{slug}", params={"tenant_id": str(world.t1)}, headers=t1_member)).json()
    ]
    t2_apps = (await c.get(f"/apps/{slug}", params={"tenant_id": str(world.t2)}, headers=t2_admin)).json()
    assert t1_versions == ["1.0.0"]
    assert [(a["version"], a["canary"]) for a in t2_apps] == [("1.0.0", False), ("1.1.0", True)]
    every = await c.get("/apps", params={"slug": slug}, headers=world.op)
    assert [a["version"] for a in every.json()] == ["1.0.0", "1.1.0"]

    # Revoking takes the app out of the tenant's catalog.
    r = await c.post(
        f"/entitlements/{ent['entitlement_id']}/revoke", json={"reason": "contract ended"}, headers=world.op
    )
    assert r.status_code == 200 and r.json()["status"] == "revoked"
    assert slug not in slugs(await c.get("/apps", params={"tenant_id": str(world.t1)}, headers=t1_member))
    r = await c.post(f"/entitlements/{ent['entitlement_id']}/revoke", headers=world.op)
    assert r.status_code == 409
    # Deprecated versions leave the listing; a compatibility check says why they cannot be deployed.
    r = await c.post(f"/manifests/{m['manifest_id']}/deprecate", json={"reason": "superseded"}, headers=world.op)
    assert r.status_code == 200 and r.json()["deprecated"] is True
    r = await c.post(f"/manifests/{m['manifest_id']}/activate", headers=world.op)
    assert r.status_code == 409 and r.json()["code"] == "manifest_deprecated"
    t2_apps = (await c.get(f"/apps/{slug}", params={"tenant_id": str(world.t2)}, headers=t2_admin)).json()
    assert [a["version"] for a in t2_apps] == ["1.1.0"]
    verdict = await c.post(
        f"/apps/{slug}/compatibility",
        json={"version": "1.0.0", "tenant_id": str(world.t2), "capacity_shape": "gpu_slice", "gpu_count": 1},
        headers=t2_admin,
    )
    assert verdict.status_code == 200
    assert verdict.json()["compatible"] is True and verdict.json()["deployable"] is False
    assert [x["code"] for x in verdict.json()["reasons"]] == ["manifest_deprecated"]


async def test_compatibility_reasons(world, flows) -> None:
    c = world.client
    slug = f"rke-{uuid.uuid4().hex[:6]}"
    await flows.active_app(
        slug,
        [world.t1],
        compatibility={
            "requires_capacity_shape": ["baremetal"],
            "min_gpu_count": 2,
            "requires_exclusive_node": True,
            "multi_allocation": False,
        },
    )
    await flows.entitle(world.t1, slug)
    h = world.headers(world.t1_member)

    async def check(**shape):
        r = await c.post(f"/apps/{slug}/compatibility", json={"tenant_id": str(world.t1), **shape}, headers=h)
        assert r.status_code == 200, r.text
        return r.json()

    ok = await check(capacity_shape="baremetal", gpu_count=8)
    assert ok["compatible"] and ok["deployable"] and ok["reasons"] == []
    bad = await check(capacity_shape="gpu_slice", gpu_count=1, allocation_count=2)
    assert [x["code"] for x in bad["reasons"]] == [
        "capacity_shape_unsupported",
        "insufficient_gpus",
        "exclusive_node_required",
        "multi_allocation_unsupported",
    ]
    assert bad["compatible"] is False and bad["deployable"] is False
    assert all(x["message"] for x in bad["reasons"])
    r = await c.post(
        f"/apps/{slug}/compatibility",
        json={"tenant_id": str(world.t2), "capacity_shape": "baremetal", "gpu_count": 1},
        headers=world.headers(world.t2_admin),
    )
    assert r.status_code == 404  # not entitled: the app does not exist for t2
    r = await c.post(f"/apps/{slug}/compatibility", json={"capacity_shape": "vm", "gpu_count": -1}, headers=h)
    assert r.status_code == 422 and r.json()["code"] == "validation_error"


async def test_seed_apps_with_honest_labels(world, registry) -> None:
    c = world.client
    tenant = await world.new_tenant(admin=world.t2_admin)
    body = {"registry": registry.address, "tenant_ids": [str(tenant)]}
    r = await c.post("/admin/seed", json=body, headers=world.headers(world.t2_admin))
    assert r.status_code == 403
    r = await c.post("/admin/seed", json=body, headers=world.op)
    assert r.status_code == 200, r.text
    first = r.json()
    assert set(first) == {"slurm-reference", "jupyter", "vllm", "rke2-self-managed"}
    again = await c.post("/admin/seed", json=body, headers=world.op)
    assert again.status_code == 200 and again.json() == first  # idempotent: same digests, same manifests

    apps = (await c.get("/apps", params={"tenant_id": str(tenant)}, headers=world.headers(world.t2_admin))).json()
    labels = {a["slug"]: (a["version"], a["runtime_version"], a["artifact_kind"]) for a in apps}
    assert labels == {
        "slurm-reference": ("1.0.0", "Slurm 22.05", "controller"),
        "jupyter": ("1.0.0", "JupyterLab 4.2", "launchable"),
        "vllm": ("1.0.0", "vLLM 0.6.3", "oci"),
        "rke2-self-managed": ("1.0.0", "RKE2 v1.30", "controller"),
    }
    for a in apps:
        assert "placeholder" in a["description"] and a["artifact_state"] == "active" and a["active"]
        assert "@sha256:" in a["artifact_ref"]
    jupyter = next(a for a in apps if a["slug"] == "jupyter")
    assert jupyter["runtime_profile"]["image"] == jupyter["artifact_ref"]
    slurm = next(a for a in apps if a["slug"] == "slurm-reference")
    assert [r["key"] for r in slurm["roles"]] == ["controller", "worker"]
