"""App runtime end to end inside one service (real Postgres, real broker, real HTTP), driven by a test
controller built on the SDK: deploy, add/remove/re-add workers, bootstrap failure and recovery, lease
expiry handoff, operator actions, honest decommission, release cascade, upgrade/rollback, credentials, SSE."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from gpuaas.contracts.enums import AllocationStatus, CapacityShape
from gpuaas.sdk import ApiError, ReconcileLoop
from gpuaas.sdk.models import PlacementIntent

from .conftest import DIGEST2, World, make_world
from .fake_controller import FakeSlurm, drive

pytestmark = pytest.mark.integration


async def deployed(w: World, workers: int = 1, **kw) -> tuple[uuid.UUID, list[uuid.UUID]]:
    allocs = [await w.allocation() for _ in range(1 + workers)]
    user = w.user(w.admin)
    inst = await user.deploy(
        w.project,
        name="hpc",
        app_slug=w.slug,
        config={"partition": "gpu"},
        placement=PlacementIntent(mode="split", controller_allocation_id=allocs[0], worker_allocation_ids=allocs[1:]),
        **kw,
    )
    await user.bind_controller(w.project, w.slug, w.sa)
    return inst.instance_id, allocs


async def status_is(w: World, instance_id: uuid.UUID, *wanted: str):
    async def check() -> bool:
        return (await w.user(w.admin).instance(instance_id)).status in wanted

    return check


async def expect(code: str, status: int, coro) -> ApiError:
    with pytest.raises(ApiError) as err:
        await coro
    assert (err.value.status, err.value.code) == (status, code), err.value.problem
    return err.value


async def test_deploy_refusals_say_why(rt, world: World) -> None:
    w = world
    user = w.user(w.admin)
    good = await w.allocation()

    def place(ctrl: uuid.UUID, *workers: uuid.UUID) -> PlacementIntent:
        return PlacementIntent(mode="split", controller_allocation_id=ctrl, worker_allocation_ids=list(workers))

    async def deploy(**kw):
        args = {"name": "x", "app_slug": w.slug, "config": {"partition": "p"}, "placement": place(good)} | kw
        return await user.deploy(w.project, **args)

    await expect("app_not_found", 404, deploy(app_slug="no-such-app"))
    await expect("invalid_config", 422, deploy(config={"nodes": 0}))
    await expect(
        "allocation_not_active", 409, deploy(placement=place(await w.allocation(status=AllocationStatus.provisioning)))
    )
    await expect("allocation_not_in_project", 422, deploy(placement=place(await w.allocation(project=w.other_project))))
    await expect("allocation_not_in_project", 422, deploy(placement=place(uuid.uuid4())))
    await w.manifest("0.9-slices", shapes=["baremetal"])
    slice_alloc = await w.allocation(shape=CapacityShape.gpu_slice, gpus=1)
    await expect("incompatible_shape", 422, deploy(app_version="0.9-slices", placement=place(slice_alloc)))
    await w.manifest("0.8-big", min_gpus=16)
    await expect("insufficient_gpus", 422, deploy(app_version="0.8-big"))
    await w.manifest("0.7-single", multi=False)
    await expect(
        "incompatible_multi_allocation",
        422,
        deploy(app_version="0.7-single", placement=place(good, await w.allocation())),
    )
    await w.manifest("0.5", deprecated=True)
    await expect("app_deprecated", 409, deploy(app_version="0.5"))
    await w.manifest("0.6-inactive", active=False)
    await expect("app_not_active", 409, deploy(app_version="0.6-inactive"))
    await expect(
        "placement_invalid",
        422,
        deploy(
            placement=PlacementIntent(
                mode="same_node", controller_allocation_id=good, worker_allocation_ids=[await w.allocation()]
            )
        ),
    )
    await expect(
        "permission_denied",
        403,
        w.user(w.viewer).deploy(w.project, name="x", app_slug=w.slug, config={"partition": "p"}, placement=place(good)),
    )
    await expect(
        "not_found",
        404,
        w.user(w.outsider).deploy(
            w.project, name="x", app_slug=w.slug, config={"partition": "p"}, placement=place(good)
        ),
    )
    unentitled = await make_world(rt, entitled=False)
    await expect(
        "app_not_entitled",
        403,
        unentitled.user(unentitled.admin).deploy(
            unentitled.project,
            name="x",
            app_slug=unentitled.slug,
            config={"partition": "p"},
            placement=place(await unentitled.allocation()),
        ),
    )
    # nothing was written by any refusal
    async with rt.kit.sessions() as s:
        n = (await s.execute(text("SELECT count(*) FROM instances WHERE project_id = :p"), {"p": w.project})).scalar()
    assert n == 0
    # and a good deploy works
    inst = await deploy()
    assert inst.status == "created" and inst.app_version == "1.0"


async def test_controller_drives_the_cluster_lifecycle(rt, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    instance_id, (a_ctl, a_w1) = await deployed(w)
    adapter = FakeSlurm()
    loop = ReconcileLoop(ctl, app_slug=w.slug, controller=adapter, lease_s=10, poll_interval_s=0.1)

    # deploy → both add operations done → running
    await drive(loop, await status_is(w, instance_id, "running"))
    members = await user.members(instance_id)
    assert sorted((m.component_key, m.allocation_id) for m in members) == sorted(
        [("slurmctld", a_ctl), ("slurmd", a_w1)]
    )
    assert all(m.status == "active" for m in members)

    # credential: public half only for users, the key pair for the bound controller; grant event covers both
    cred = await user.credential(instance_id)
    assert "private_key" not in (await user.request("GET", f"/instances/{instance_id}/credential"))
    assert adapter.fingerprints == {cred.fingerprint}
    grants = await rt.outbox("access_grant.requested", cred.credential_id)
    assert grants and sorted(grants[-1]["data"]["allocation_ids"]) == sorted(map(str, [a_ctl, a_w1]))
    assert "PRIVATE" not in str(grants)
    await expect("not_the_controller", 403, w.controller(w.sa_other).fetch_credential(instance_id))
    await expect("controller_only", 403, user.fetch_credential(instance_id))
    async with rt.kit.sessions() as s:
        stored = (
            await s.execute(
                text("SELECT ciphertext, custody FROM credentials WHERE instance_id = :i"), {"i": instance_id}
            )
        ).one()
    assert stored.custody == "schema" and b"OPENSSH" not in stored.ciphertext

    # add a worker on a second allocation → the grant follows
    a_w2 = await w.allocation()
    await user.request_operation(instance_id, "add", allocation_id=a_w2)
    assert (await user.instance(instance_id)).status == "running"

    async def three_active() -> bool:
        ms = await user.members(instance_id)
        return len(ms) == 3 and all(m.status == "active" for m in ms)

    await drive(loop, three_active)
    updated = await rt.outbox("access_grant.updated", cred.credential_id)
    assert str(a_w2) in updated[-1]["data"]["allocation_ids"]

    # remove that worker (tombstone stays auditable) and add it back
    w2 = next(m for m in await user.members(instance_id) if m.allocation_id == a_w2)
    await user.request_operation(instance_id, "remove", member_id=w2.member_id)
    await expect("operation_in_flight", 409, user.request_operation(instance_id, "drain", member_id=w2.member_id))

    async def removed() -> bool:
        return len(await user.members(instance_id)) == 2

    await drive(loop, removed)
    tomb = next(m for m in await user.members(instance_id, include_tombstones=True) if m.member_id == w2.member_id)
    assert tomb.tombstoned and tomb.status == "removed"
    await user.request_operation(instance_id, "add", allocation_id=a_w2)
    await drive(loop, three_active)

    # a worker that fails bootstrap → degraded; recovered → running, the failed member kept as a tombstone
    a_bad = await w.allocation()
    adapter.fail_bootstrap.add(a_bad)
    await ctl.request_operation(instance_id, "add", allocation_id=a_bad, as_controller=True)
    await drive(loop, await status_is(w, instance_id, "degraded"))
    failed = next(m for m in await user.members(instance_id) if m.allocation_id == a_bad)
    assert failed.status == "failed"
    recover = await user.request_operation(instance_id, "recover", member_id=failed.member_id)
    await drive(loop, await status_is(w, instance_id, "running"))
    everyone = await user.members(instance_id, include_tombstones=True)
    old = next(m for m in everyone if m.member_id == failed.member_id)
    new = next(m for m in everyone if m.member_id != failed.member_id and m.allocation_id == a_bad)
    assert old.tombstoned and old.status == "failed" and "recover" in (old.tombstone_reason or "")
    assert new.status == "active"
    ops = {o.operation_id: o for o in await user.operations(instance_id)}
    assert ops[recover.operation_id].status == "succeeded"
    assert ops[recover.operation_id].result_member_id == new.member_id

    # controller reports: health, runtime detail, member detail, adapter events in the timeline
    await ctl.report_instance(
        instance_id,
        health={"status": "healthy", "message": "all partitions up"},
        runtime_detail={"partitions": ["gpu"]},
    )
    await ctl.report_member(new.member_id, detail={"slurm_state": "IDLE"})
    inst = await user.instance(instance_id)
    assert inst.runtime_detail == {"partitions": ["gpu"]} and inst.health.status == "healthy"
    kinds = [e.kind for e in await user.timeline(instance_id)]
    for k in (
        "instance.created",
        "operation.claimed",
        "operation.succeeded",
        "operation.failed",
        "member.tombstoned",
        "controller.node_joined",
        "instance.degraded",
        "instance.running",
    ):
        assert k in kinds, k

    # honest decommission with verified teardown of every member
    await user.decommission(instance_id, "project finished")
    await drive(loop, await status_is(w, instance_id, "decommissioned", "decommission_failed"))
    inst = await user.instance(instance_id)
    assert inst.status == "decommissioned"
    assert inst.decommission and not inst.decommission.forced and not inst.decommission.unverified_member_ids
    assert len(inst.decommission.verified_member_ids) == 4
    assert await user.members(instance_id) == []
    assert await rt.outbox("access_grant.revoked", cred.credential_id)
    await expect("credential_not_found", 404, ctl.fetch_credential(instance_id))


async def scrape(rt) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The service's /metrics, by (name, sorted labels)."""
    async with httpx.AsyncClient(base_url=rt.url, timeout=30) as c:
        body = (await c.get("/metrics")).text
    return {
        (m.name, tuple(sorted(m.labels.items()))): m.value
        for f in text_string_to_metric_families(body)
        for m in f.samples
    }


async def test_killed_controller_lease_expires_and_another_replica_finishes(rt, world: World) -> None:
    w = world
    expiries = (await scrape(rt)).get(
        ("gpuaas_member_operation_lease_expiries_total", (("service", "app_runtime"),)), 0
    )
    user = w.user(w.admin)
    instance_id, (_a_ctl, a_w1) = await deployed(w)
    hanging = FakeSlurm()
    hanging.hang_on.add(a_w1)
    first = ReconcileLoop(
        w.controller(), app_slug=w.slug, controller=hanging, lease_s=5, poll_interval_s=0.1, holder="replica-1"
    )
    task = asyncio.create_task(first.run())

    async def worker_claimed() -> bool:  # and the head's add done (the replica works on both at once)
        ops = await user.operations(instance_id)
        return any(o.status in ("claimed", "in_progress") and o.allocation_id == a_w1 for o in ops) and any(
            o.status == "succeeded" and o.allocation_id == _a_ctl for o in ops
        )

    deadline = asyncio.get_running_loop().time() + 20
    while not await worker_claimed():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.1)
    task.cancel()  # the replica dies mid-operation: nothing is reported
    await asyncio.gather(task, return_exceptions=True)
    op = next(o for o in await user.operations(instance_id) if o.allocation_id == a_w1)
    assert op.status in ("claimed", "in_progress") and "replica-1" in (op.claimed_by or "")
    # a second replica cannot take it while the lease is live
    second_ctl = w.controller()
    await expect("operation_not_claimable", 409, second_ctl.claim(w.slug, operation_id=op.operation_id))

    second = ReconcileLoop(
        second_ctl, app_slug=w.slug, controller=FakeSlurm(), lease_s=5, poll_interval_s=0.2, holder="replica-2"
    )
    await drive(second, await status_is(w, instance_id, "running"), timeout_s=40)
    done = next(o for o in await user.operations(instance_id) if o.operation_id == op.operation_id)
    assert done.status == "succeeded" and done.attempt == 2 and "replica-2" in (done.claimed_by or "")
    assert any("expired" in e.message for e in await user.timeline(instance_id))
    assert await rt.outbox("member_operation.requeued", op.operation_id)
    # issue 16: the expiry is counted once (reconciler or re-claim), the operations gauge reads the table
    samples = await scrape(rt)
    assert samples[("gpuaas_member_operation_lease_expiries_total", (("service", "app_runtime"),))] == expiries + 1
    async with rt.kit.sessions() as s:
        sql = "SELECT count(*) FROM operations WHERE kind = 'add' AND status = 'succeeded'"
        succeeded = (await s.execute(text(sql))).scalar_one()
    key = (("kind", "add"), ("service", "app_runtime"), ("status", "succeeded"))
    assert samples[("gpuaas_member_operations", key)] == succeeded >= 2


async def test_operator_retry_cancel_force_fail(rt, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    instance_id, (_a_ctl, _a_w1) = await deployed(w)
    claim = await ctl.claim(w.slug, lease_s=600, holder="stuck")
    assert claim is not None
    stuck = claim.operation
    # a stuck operation (lease for 10 minutes) is force-failed by an operator, with a reason
    await expect("reason_required", 422, user.force_fail_operation(stuck.operation_id, ""))
    await expect("permission_denied", 403, w.user(w.viewer).force_fail_operation(stuck.operation_id, "x"))
    ff = await user.force_fail_operation(stuck.operation_id, "controller host lost")
    assert ff.status == "failed" and ff.forced
    # the old holder's report is refused (it lost the lease)
    await expect("lease_lost", 409, ctl.complete(stuck.operation_id, claim.lease_token))
    # retry puts it back to pending; a controller finishes it
    again = await user.retry_operation(stuck.operation_id, "host back")
    assert again.status == "pending" and not again.forced
    await drive(
        ReconcileLoop(ctl, app_slug=w.slug, controller=FakeSlurm(), poll_interval_s=0.1),
        await status_is(w, instance_id, "running"),
    )
    # cancel: an add nobody has claimed yet; its member becomes a tombstone
    pending = await user.request_operation(instance_id, "add", allocation_id=await w.allocation())
    cancelled = await user.cancel_operation(pending.operation_id, "changed my mind")
    assert cancelled.status == "cancelled"
    await expect("invalid_operation_transition", 409, user.cancel_operation(pending.operation_id, "again"))
    assert len(await user.members(instance_id)) == 2
    audit = await rt.outbox("audit.recorded")
    actions = {a["data"]["action"] for a in audit if a["data"]["resource_id"] == str(stuck.operation_id)}
    assert {"apps.operation.force_fail", "apps.operation.retry"} <= actions


async def test_decommission_without_verified_teardown_fails_then_forced(rt, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    instance_id, (_a_ctl, a_w1) = await deployed(w)
    adapter = FakeSlurm()
    loop = ReconcileLoop(ctl, app_slug=w.slug, controller=adapter, poll_interval_s=0.1)
    await drive(loop, await status_is(w, instance_id, "running"))
    adapter.unverified.add(a_w1)
    await user.decommission(instance_id, "done")
    await drive(loop, await status_is(w, instance_id, "decommission_failed", "decommissioned"))
    inst = await user.instance(instance_id)
    assert inst.status == "decommission_failed"
    report = inst.decommission
    assert report is not None and len(report.unverified_member_ids) == 1 and len(report.verified_member_ids) == 1
    assert any("host unreachable" in e for e in report.evidence)
    assert (await user.credential(instance_id)).status == "active"  # nothing revoked on a failed teardown
    # the forced path: recorded as forced, with who and why
    await expect("reason_required", 422, user.force_decommission(instance_id, " "))
    forced = await user.force_decommission(instance_id, "host destroyed by provider")
    assert forced.status == "decommissioned" and forced.decommission and forced.decommission.forced
    assert forced.decommission.unverified_member_ids == report.unverified_member_ids
    assert any("FORCED" in e for e in forced.decommission.evidence)
    audit = [a for a in await rt.outbox("audit.recorded") if a["data"]["action"] == "apps.instance.decommission.force"]
    assert audit and audit[-1]["data"]["reason"] == "host destroyed by provider"
    events = await rt.outbox("instance.decommissioned", instance_id)
    assert events[-1]["data"]["decommission"]["forced"] is True


async def test_releasing_an_allocation_removes_its_members_first(rt, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    instance_id, (a_ctl, a_w1) = await deployed(w)
    loop = ReconcileLoop(ctl, app_slug=w.slug, controller=FakeSlurm(), poll_interval_s=0.1)
    await drive(loop, await status_is(w, instance_id, "running"))
    await w.allocation(allocation_id=a_w1, status=AllocationStatus.releasing)
    assert not await rt.outbox("release_clearance.granted", a_w1)  # not before the member is gone
    assert (await user.instance(instance_id)).status == "degraded"

    async def cleared() -> bool:
        return bool(await rt.outbox("release_clearance.granted", a_w1))

    await drive(loop, cleared)
    clearance = (await rt.outbox("release_clearance.granted", a_w1))[-1]["data"]
    assert clearance["forced"] is False and clearance["instance_ids"] == [str(instance_id)]
    members = await user.members(instance_id)
    assert [m.allocation_id for m in members] == [a_ctl]
    # an allocation with nothing of ours on it is cleared at once
    idle = await w.allocation()
    await w.allocation(allocation_id=idle, status=AllocationStatus.releasing)
    assert await rt.outbox("release_clearance.granted", idle)


async def test_upgrade_and_rollback(rt, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    instance_id, _ = await deployed(w)
    adapter = FakeSlurm()
    loop = ReconcileLoop(ctl, app_slug=w.slug, controller=adapter, poll_interval_s=0.1)
    await drive(loop, await status_is(w, instance_id, "running"))
    await expect("no_previous_version", 409, user.rollback(instance_id))
    await w.manifest("2.0", digest=DIGEST2)
    inst = await user.upgrade(instance_id, "2.0")
    assert inst.desired_app_version == "2.0" and inst.app_version == "1.0"

    async def on(version: str):
        async def check() -> bool:
            i = await user.instance(instance_id)
            return i.app_version == version and i.desired_app_version is None

        return check

    await drive(loop, await on("2.0"))
    inst = await user.instance(instance_id)
    assert inst.artifact_digest == DIGEST2 and inst.runtime_detail == {"slurm_version": "2.0"}
    await user.rollback(instance_id)
    await drive(loop, await on("1.0"))
    assert (await user.instance(instance_id)).artifact_digest.endswith("1" * 64)
    await w.manifest("3.0", deprecated=True)
    await expect("app_deprecated", 409, user.upgrade(instance_id, "3.0"))


async def test_credential_rotation_and_timeline_stream(rt, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    instance_id, _ = await deployed(w)
    seen: list[str] = []

    async def listen() -> None:
        async for entry in user.stream_timeline(instance_id):
            seen.append(entry.kind)
            if entry.kind == "credential.rotated":
                return

    listener = asyncio.create_task(listen())
    old = await ctl.fetch_credential(instance_id)
    new = await user.rotate_credential(instance_id)
    assert new.fingerprint != old.fingerprint and new.rotated_from == old.credential_id
    assert (await ctl.fetch_credential(instance_id)).fingerprint == new.fingerprint
    assert await rt.outbox("access_grant.revoked", old.credential_id)
    await asyncio.wait_for(listener, 15)
    assert seen[0] == "instance.created" and "credential.rotated" in seen
    await expect("instance_not_found", 404, w.user(w.outsider).instance(instance_id))
    await expect("permission_denied", 403, w.user(w.viewer).rotate_credential(instance_id))
