"""Runtime images (`artifact_kind: runtime`): OCI artifacts under the same promotion gates and trust
checks as other OCI apps; a runtime manifest is offered only while its artifact is active, and the
catalog's events (what allocations projects) carry the kind."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import select

from gpuaas.kit.tables import outbox

pytestmark = pytest.mark.integration


async def test_runtime_manifest_follows_the_artifact_lifecycle(world, flows, registry) -> None:
    slug = f"rt-{uuid.uuid4().hex[:8]}"
    img = await flows.image(repo=f"runtimes/{slug}")
    art = await flows.register(img.ref)
    body = {
        "slug": slug,
        "display_name": "Runtime",
        "version": "1.0.0",
        "artifact_kind": "runtime",
        "artifact_ref": img.ref,
    }

    async def post(**extra: object) -> object:
        return await world.client.post("/apps", json={**body, **extra}, headers=world.op)

    # A tag is never a runtime: the reference is pinned by digest, as for every OCI artifact.
    r = await post(artifact_ref=f"{registry.address}/{img.repository}:v1")
    assert r.status_code == 422 and r.json()["code"] == "artifact_ref_not_pinned"
    r = await post(runtime_profile={"image": img.ref})
    assert r.status_code == 422 and r.json()["code"] == "runtime_profile_not_applicable"
    r = await post(active=True)  # offered needs an active artifact: the draft has passed no gate
    assert r.status_code == 409 and r.json()["code"] == "artifact_not_active"
    r = await post()
    assert r.status_code == 201, r.text
    manifest = r.json()
    assert manifest["artifact_kind"] == "runtime" and manifest["active"] is False

    # The gates: lint + smoke recorded, staged (content re-verified against the registry), canary, active.
    r = await flows.move(art["artifact_id"], "staged")
    assert r.status_code == 409 and r.json()["code"] == "artifact_checks_missing"
    active = await flows.to_active(art["artifact_id"], [world.t1])
    assert active["state"] == "active"
    assert any(c["name"] == "content" and c["passed"] for c in active["checks"])
    r = await world.client.post(
        f"/manifests/{manifest['manifest_id']}/activate",
        json={"reason": "runtime offered"},
        headers={**world.op, "If-Match": f'"{manifest["revision"]}"'},
    )
    assert r.status_code == 200 and r.json()["active"] is True, r.text

    # Deprecating the artifact withdraws the runtime; retiring it ends it; a retired one cannot be registered.
    assert (await flows.move(art["artifact_id"], "deprecated")).status_code == 200
    r = await world.client.get(f"/manifests/{manifest['manifest_id']}", headers=world.op)
    assert r.json()["deprecated"] is True and r.json()["active"] is False
    assert (await flows.move(art["artifact_id"], "retired")).status_code == 200
    r = await post(version="1.0.1")
    assert r.status_code == 409 and r.json()["code"] == "artifact_retired"

    # What allocations consumes: the manifest events say `runtime` and pin the digest.
    async with world.kit.sessions() as s:
        rows = (
            await s.execute(
                select(outbox.c.event_type, outbox.c.payload).where(outbox.c.aggregate_id == manifest["manifest_id"])
            )
        ).all()
    events = {r.event_type: json.loads(r.payload)["data"] for r in rows if r.event_type.startswith("app.")}
    assert {"app.registered", "app.updated", "app.deprecated"} <= set(events)
    assert all(e["artifact_kind"] == "runtime" and e["artifact_ref"] == img.ref for e in events.values())
