"""Artifact lifecycle gates: transition table, recorded lint/smoke, canary tenants, rollback,
re-verification on promotion, deprecation cascading to manifests, retire gated by the projection of
app-runtime's instances (fed through the real broker), the audit trail of every move."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import httpx
import pytest
from sqlalchemy import select

from gpuaas.catalog.oci import ACCEPT
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events import app_runtime as ar
from gpuaas.kit.kafka import make_producer
from gpuaas.kit.tables import outbox
from gpuaas.kit.testing import wait_for
from gpuaas.kit.testing_events import signed_payload

pytestmark = pytest.mark.integration


async def test_promotion_gates_in_order(world, flows) -> None:
    art = await flows.register((await flows.image()).ref)
    aid = art["artifact_id"]

    r = await flows.move(aid, "active")
    assert r.status_code == 409 and r.json()["code"] == "transition_not_allowed"
    r = await flows.move(aid, "staged")
    assert r.status_code == 409 and r.json()["code"] == "artifact_checks_missing"
    assert r.json()["missing"] == ["lint", "smoke"]
    await flows.check(aid, "lint")
    await flows.check(aid, "smoke", passed=False)
    r = await flows.move(aid, "staged")
    assert r.status_code == 409 and r.json()["missing"] == ["smoke"]
    await flows.check(aid, "smoke")
    bad = await world.client.post(
        f"/artifacts/{aid}/checks", json={"name": "content", "passed": True}, headers=world.op
    )
    assert bad.status_code == 422  # the service records content checks itself

    no_reason = await world.client.post(f"/artifacts/{aid}/transitions", json={"to": "staged"}, headers=world.op)
    assert no_reason.status_code == 422
    r = await flows.move(aid, "staged")
    assert r.status_code == 200 and r.json()["state"] == "staged"
    assert any(c["name"] == "content" and c["detail"].startswith("re-verified") for c in r.json()["checks"])

    r = await flows.move(aid, "canary")
    assert r.status_code == 409 and r.json()["code"] == "canary_tenants_required"
    r = await flows.move(aid, "canary", canary_tenants=[str(uuid.uuid4())])
    assert r.status_code == 422 and r.json()["code"] == "tenant_unknown"
    r = await flows.move(aid, "canary", canary_tenants=[str(world.t1)])
    assert r.status_code == 200 and r.json()["canary_tenants"] == [str(world.t1)]
    version = r.json()["version"]

    stale = await world.client.post(
        f"/artifacts/{aid}/transitions",
        json={"to": "staged", "reason": "rollback"},
        headers={**world.op, "If-Match": f'"{version - 1}"'},
    )
    assert stale.status_code == 412 and stale.json()["code"] == "version_mismatch"
    r = await world.client.post(
        f"/artifacts/{aid}/transitions",
        json={"to": "staged", "reason": "canary error rate"},
        headers={**world.op, "If-Match": f'"{version}"'},
    )
    assert r.status_code == 200 and r.json()["state"] == "staged" and r.json()["canary_tenants"] == []
    for to in ("canary", "active", "deprecated"):
        r = await flows.move(aid, to, canary_tenants=[str(world.t2)])
        assert r.status_code == 200, r.text
    r = await flows.move(aid, "active")
    assert r.status_code == 409 and r.json()["code"] == "transition_not_allowed"
    r = await flows.move(aid, "retired")
    assert r.status_code == 200 and r.json()["state"] == "retired"
    r = await flows.move(aid, "deprecated")
    assert r.status_code == 409

    history = (await world.client.get(f"/artifacts/{aid}/history", headers=world.op)).json()
    moves = [(h["from_state"], h["to_state"]) for h in history]
    assert moves == [
        (None, "draft"),
        ("draft", "staged"),
        ("staged", "canary"),
        ("canary", "staged"),
        ("staged", "canary"),
        ("canary", "active"),
        ("active", "deprecated"),
        ("deprecated", "retired"),
    ]
    assert history[3]["reason"] == "canary error rate" and history[3]["actor_id"] == str(world.operator)

    # Every move was audited (actor, before, after, reason) in the same transaction, via the outbox.
    async with world.kit.sessions() as s:
        rows = (await s.execute(select(outbox.c.payload).where(outbox.c.event_type == "audit.recorded"))).all()
    import json

    audits = [json.loads(r[0]) for r in rows]
    mine = [
        a for a in audits if a["data"]["resource_id"] == aid and a["data"]["action"].startswith("catalog.artifact.")
    ]
    rollback = [a for a in mine if a["data"]["reason"] == "canary error rate"]
    assert len(rollback) == 1
    assert rollback[0]["data"]["before"]["state"] == "canary" and rollback[0]["data"]["after"]["state"] == "staged"
    assert rollback[0]["actor"] == {"kind": "user", "id": str(world.operator)}
    transitions = [
        a
        for a in mine
        if a["data"]["action"]
        in {f"catalog.artifact.{s}" for s in ("staged", "canary", "active", "deprecated", "retired")}
    ]
    assert len(transitions) == 7
    async with world.kit.sessions() as s:
        types = [r[0] for r in await s.execute(select(outbox.c.event_type).where(outbox.c.aggregate_id == aid))]
    assert types.count("artifact.transitioned") == 7 and types.count("artifact.registered") == 1


async def test_tampering_after_registration_blocks_promotion(world, flows, registry) -> None:
    ref = await flows.image()
    art = await flows.register(ref.ref)
    await flows.check(art["artifact_id"], "lint")
    await flows.check(art["artifact_id"], "smoke")
    async with httpx.AsyncClient(base_url=registry.url) as h:
        manifest = (await h.get(f"/v2/{ref.repository}/manifests/{ref.digest}", headers={"Accept": ACCEPT})).json()
    registry.blob_file(manifest["config"]["digest"]).write_bytes(b'{"os":"evil"}')
    r = await flows.move(art["artifact_id"], "staged")
    assert r.status_code == 422 and r.json()["code"] == "artifact_content_tampered"
    now = (await world.client.get(f"/artifacts/{art['artifact_id']}", headers=world.op)).json()
    assert now["state"] == "draft"
    assert next(c for c in now["checks"] if c["name"] == "content")["passed"] is False


async def _publish(bootstrap: str, *events: ar.InstanceCreated) -> None:
    producer = make_producer(bootstrap, 1_000_000)
    await producer.start()
    try:
        for e in events:
            await producer.send_and_wait(e.topic, signed_payload(e), key=e.key())  # as its producer's relay signs
    finally:
        await producer.stop()


def _instance(
    instance_id: uuid.UUID,
    tenant: uuid.UUID,
    manifest_id: str,
    digest: str,
    status: InstanceStatus,
    version: int,
    cls: type = ar.InstanceCreated,
) -> ar.InstanceCreated:
    state = ar.InstanceState(
        instance_id=instance_id,
        tenant_id=tenant,
        project_id=uuid.uuid4(),
        app_slug="x",
        app_version="1.0.0",
        manifest_id=uuid.UUID(manifest_id),
        artifact_digest=digest,
        status=status,
        status_changed_at=datetime.now(UTC),
        version=version,
    )
    return cls.build(data=state, source="app-runtime")


async def test_retire_refused_while_an_instance_uses_the_digest(world, flows, infra) -> None:
    slug = f"ret-{uuid.uuid4().hex[:6]}"
    art, manifest = await flows.active_app(slug, [world.t1])
    aid, digest = art["artifact_id"], art["digest"]
    instance = uuid.uuid4()
    await _publish(
        infra.kafka_bootstrap,
        _instance(instance, world.t1, manifest["manifest_id"], digest, InstanceStatus.running, 3, ar.InstanceRunning),
    )

    async def projected(status: str) -> bool:
        async with world.kit.sessions() as s:
            from gpuaas.catalog.models import instance_digests

            row = (
                await s.execute(select(instance_digests.c.status).where(instance_digests.c.instance_id == instance))
            ).first()
        return row is not None and row[0] == status

    await wait_for(lambda: projected("running"), 30, "instance projected")

    r = await flows.move(aid, "deprecated")
    assert r.status_code == 200
    # Deprecating the artifact deprecated its (active) manifest: no new instance may use it.
    m = (await world.client.get(f"/manifests/{manifest['manifest_id']}", headers=world.op)).json()
    assert m["deprecated"] is True and m["active"] is False
    r = await flows.move(aid, "retired")
    assert r.status_code == 409 and r.json()["code"] == "artifact_in_use" and r.json()["instances"] == 1

    # A stale, older event does not bring back a state that was already superseded.
    await _publish(
        infra.kafka_bootstrap,
        _instance(
            instance,
            world.t1,
            manifest["manifest_id"],
            digest,
            InstanceStatus.decommissioned,
            5,
            ar.InstanceDecommissioned,
        ),
        _instance(instance, world.t1, manifest["manifest_id"], digest, InstanceStatus.starting, 2, ar.InstanceStarting),
    )
    await wait_for(lambda: projected("decommissioned"), 30, "decommission projected")
    marker = uuid.uuid4()
    await _publish(
        infra.kafka_bootstrap,
        _instance(marker, world.t1, manifest["manifest_id"], "sha256:" + "f" * 64, InstanceStatus.created, 1),
    )

    async def seen_marker() -> bool:
        async with world.kit.sessions() as s:
            from gpuaas.catalog.models import instance_digests

            return (
                await s.execute(select(instance_digests.c.instance_id).where(instance_digests.c.instance_id == marker))
            ).first() is not None

    await wait_for(seen_marker, 30, "marker projected")  # same partition order is not guaranteed; wait for all
    assert await projected("decommissioned")
    r = await flows.move(aid, "retired")
    assert r.status_code == 200 and r.json()["state"] == "retired"
    # A retired artifact cannot back a new manifest.
    r = await world.client.post(
        "/apps",
        json={
            "slug": slug,
            "display_name": "x",
            "version": "2.0.0",
            "artifact_kind": "oci",
            "artifact_ref": art["ref"],
        },
        headers=world.op,
    )
    assert r.status_code == 409 and r.json()["code"] == "artifact_retired"
