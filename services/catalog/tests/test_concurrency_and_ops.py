"""Concurrent promotions (row locks: exactly one wins), service-account reads, the snapshot endpoint
for projection bootstrap, domain metrics, idempotent POSTs."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from sqlalchemy import func, select

from gpuaas.contracts.events import identity as ev
from gpuaas.kit.iam import apply_locally
from gpuaas.kit.tables import outbox

pytestmark = pytest.mark.integration


async def test_concurrent_transitions_and_grants_do_not_double_apply(world, flows) -> None:
    art = await flows.register((await flows.image()).ref)
    aid = art["artifact_id"]
    await flows.check(aid, "lint")
    await flows.check(aid, "smoke")
    results = await asyncio.gather(*[flows.move(aid, "staged") for _ in range(6)])
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 409, 409, 409, 409, 409], [r.text for r in results]
    assert {r.json()["code"] for r in results if r.status_code == 409} == {"transition_not_allowed"}
    history = (await world.client.get(f"/artifacts/{aid}/history", headers=world.op)).json()
    assert [h["to_state"] for h in history] == ["draft", "staged"]

    slug = f"conc-{uuid.uuid4().hex[:6]}"
    await flows.active_app(slug, [world.t1])
    grants = await asyncio.gather(
        *[
            world.client.post("/entitlements", json={"tenant_id": str(world.t1), "app_slug": slug}, headers=world.op)
            for _ in range(5)
        ]
    )
    assert sorted(g.status_code for g in grants) == [201, 409, 409, 409, 409]
    ents = (await world.client.get("/entitlements", params={"tenant_id": str(world.t1)}, headers=world.op)).json()
    assert [e["app_slug"] for e in ents].count(slug) == 1


async def test_idempotency_key_replays_the_first_answer(world, flows) -> None:
    ref = (await flows.image()).ref
    headers = {**world.op, "Idempotency-Key": uuid.uuid4().hex}
    first = await world.client.post("/artifacts", json={"ref": ref}, headers=headers)
    second = await world.client.post("/artifacts", json={"ref": ref}, headers=headers)
    assert first.status_code == second.status_code == 201
    assert first.json()["artifact_id"] == second.json()["artifact_id"]


async def test_a_check_result_run_twice_is_recorded_once(world, flows) -> None:
    """A check request whose process died after its commit, before its response was stored, runs again when
    the retry takes the stale Idempotency-Key reservation over: the same result must not be recorded twice
    (found by tests/faults: catalog killed mid promotion). A different result is a new record."""
    aid = (await flows.register((await flows.image()).ref))["artifact_id"]
    body = {"name": "lint", "passed": True, "detail": "ci run 42"}
    first = await world.client.post(f"/artifacts/{aid}/checks", json=body, headers=world.op)
    again = await world.client.post(f"/artifacts/{aid}/checks", json=body, headers=world.op)
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json()  # the same version: nothing new was recorded
    other = await world.client.post(f"/artifacts/{aid}/checks", json={**body, "detail": "ci run 43"}, headers=world.op)
    assert other.status_code == 200 and other.json()["version"] == first.json()["version"] + 1
    async with world.kit.sessions() as s:
        audits = (
            await s.execute(
                select(func.count())
                .select_from(outbox)
                .where(outbox.c.aggregate_id == aid, outbox.c.event_type == "audit.recorded")
            )
        ).scalar_one()
    assert audits == 3  # register, lint (once), lint again with another result


async def test_service_account_reads_its_tenants_catalog(world, flows) -> None:
    slug = f"sa-{uuid.uuid4().hex[:6]}"
    await flows.active_app(slug, [world.t1])
    await flows.entitle(world.t1, slug)
    sa = uuid.uuid4()
    async with world.kit.sessions() as s, s.begin():
        await apply_locally(
            s,
            ev.ServiceAccountCreated.build(
                source="identity",
                data=ev.ServiceAccountState(
                    service_account_id=sa,
                    tenant_id=world.t1,
                    project_id=world.p1,
                    name="ctl",
                    scopes=["app-controller"],
                ),
            ),
        )
    h = world.headers(sa, kind="service_account", project_id=str(world.p1), scope="app-controller")
    r = await world.client.get("/apps", headers=h)
    assert r.status_code == 200 and slug in {a["slug"] for a in r.json()}
    r = await world.client.get("/apps", params={"tenant_id": str(world.t2)}, headers=h)
    assert r.status_code == 404
    r = await world.client.get("/artifacts", headers=h)
    assert r.status_code == 404  # operator surface: a service account acts only inside its project
    unscoped = world.headers(sa, kind="service_account", project_id=str(world.p1))
    assert (await world.client.get("/apps", headers=unscoped)).status_code == 403


async def test_snapshot_pages_full_state_and_metrics_count(world, flows) -> None:
    await flows.active_app(f"snap-{uuid.uuid4().hex[:6]}", [world.t1])
    seen: list[dict] = []
    after = None
    while True:
        params = {"limit": 2, **({"after": after} if after else {})}
        r = await world.client.get("/snapshot/artifacts", params=params, headers=world.op)
        assert r.status_code == 200
        seen += r.json()["items"]
        after = r.json()["next"]
        if after is None:
            break
    ids = [a["artifact_id"] for a in seen]
    assert len(ids) == len(set(ids)) >= 1 and ids == sorted(ids)
    assert all("@sha256:" in a["ref"] and "state" in a for a in seen)
    r = await world.client.get("/snapshot/manifests", headers=world.headers(world.t1_admin))
    assert r.status_code == 403
    r = await world.client.get("/snapshot/nonsense", headers=world.op)
    assert r.status_code == 422
    text = (await world.client.get("/metrics")).text
    assert 'gpuaas_artifact_verifications_total{outcome="verified",service="catalog"}' in text
    assert 'gpuaas_artifact_transitions_total{service="catalog",to="active"}' in text
