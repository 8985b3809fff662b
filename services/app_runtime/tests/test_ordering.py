"""Ordered, concurrent and deferred operations against the real service (Postgres, broker, HTTP): a manifest
role's `after` holds operations back when the runtime hands them out (workers come up after the head is up,
and are taken away before it), a controller can defer an operation without burning an attempt, heartbeats keep
the claim's lease length, member detail can be reported while an operation runs, a planned drain never
degrades the instance, a preemption notice drains the members on its allocation, and a decommissioned instance
drops its runtime detail."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gpuaas.contracts.events import allocations as al
from gpuaas.contracts.events import catalog as cat
from gpuaas.kit.testing import wait_for
from gpuaas.kit.testing_events import publish
from gpuaas.sdk import Controller, OperationContext, ReconcileLoop
from gpuaas.sdk.controller.loop import drain_deadline_s
from gpuaas.sdk.models import Operation

from .conftest import World
from .fake_controller import FakeSlurm, drive
from .test_runtime import deployed, expect, status_is

pytestmark = pytest.mark.integration

ORDERED = "2.0-ordered"


async def ordered(w: World) -> None:
    await w.manifest(ORDERED, roles=[cat.AppRole(key="slurmctld"), cat.AppRole(key="slurmd", after=["slurmctld"])])


class Recorder(Controller):
    """Records the order it handled operations in; a worker's add checks the head is up, a head's remove that
    no worker is left (what an app needing the order would fail on)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.head_up = False
        self.workers = 0

    async def add(self, ctx: OperationContext) -> dict[str, Any]:
        role = ctx.role or ""
        if role == "slurmd":
            assert self.head_up, "a worker was brought up before its head"
            self.workers += 1
        else:
            self.head_up = True
        self.log.append(("add", role))
        return {}

    async def remove(self, ctx: OperationContext) -> dict[str, Any]:
        role = ctx.role or ""
        if role == "slurmctld":
            assert self.workers == 0, "the head was removed before its workers"
            self.head_up = False
        else:
            self.workers -= 1
        self.log.append(("remove", role))
        return {"teardown_verified": True, "evidence": f"{role} gone"}


async def test_role_order_on_deploy_and_decommission(rt, world: World) -> None:
    w = world
    await ordered(w)
    user, ctl = w.user(w.admin), w.controller()
    instance_id, _ = await deployed(w, workers=3, app_version=ORDERED)
    ops = await user.operations(instance_id)
    head = next(o for o in ops if o.component_key == "slurmctld")
    worker = next(o for o in ops if o.component_key == "slurmd")

    # a worker's add claimed before the head is up: refused, saying why; claim-next hands out the head's
    err = await expect("operation_held", 409, ctl.claim(w.slug, operation_id=worker.operation_id, lease_s=30))
    assert "slurmctld" in err.problem["detail"]
    claim = await ctl.claim(w.slug, lease_s=30)
    assert claim is not None and claim.operation.operation_id == head.operation_id
    assert await ctl.claim(w.slug, lease_s=30) is None  # the workers wait while the head is starting
    await ctl.complete(head.operation_id, claim.lease_token, result={})

    # the rest converges with several operations at once: every worker after the head
    adapter = Recorder()
    adapter.head_up = True
    loop = ReconcileLoop(ctl, app_slug=w.slug, controller=adapter, lease_s=10, poll_interval_s=0.1)
    loop.max_concurrent_operations = 4
    await drive(loop, await status_is(w, instance_id, "running"))
    assert adapter.log == [("add", "slurmd")] * 3

    # decommission: the workers' removes are handed out first, the head's once they are done
    await user.decommission(instance_id, "done")
    removes = {o.component_key: o for o in await user.operations(instance_id) if o.kind == "remove"}
    await expect("operation_held", 409, ctl.claim(w.slug, operation_id=removes["slurmctld"].operation_id, lease_s=30))
    adapter.log.clear()
    await drive(loop, await status_is(w, instance_id, "decommissioned", "decommission_failed"))
    assert adapter.log == [("remove", "slurmd")] * 3 + [("remove", "slurmctld")]
    inst = await user.instance(instance_id)
    assert inst.status == "decommissioned"


async def test_a_newer_head_recovery_is_handed_out_before_an_older_worker_add(rt, world: World) -> None:
    w = world
    await ordered(w)
    user, ctl = w.user(w.admin), w.controller()
    instance_id, _ = await deployed(w, workers=1, app_version=ORDERED)
    adapter = Recorder()
    loop = ReconcileLoop(ctl, app_slug=w.slug, controller=adapter, lease_s=10, poll_interval_s=0.1)
    await drive(loop, await status_is(w, instance_id, "running"))
    head = next(m for m in await user.members(instance_id) if m.component_key == "slurmctld")
    await ctl.report_member(head.member_id, status="failed")
    older = await user.request_operation(instance_id, "add", allocation_id=await w.allocation())
    newer = await user.request_operation(instance_id, "recover", member_id=head.member_id)
    claim = await ctl.claim(w.slug, lease_s=30)
    assert claim is not None and claim.operation.operation_id == newer.operation_id
    assert await ctl.claim(w.slug, lease_s=30) is None  # the worker's add waits for the recovered head
    await ctl.complete(newer.operation_id, claim.lease_token, result={})
    claim = await ctl.claim(w.slug, lease_s=30)
    assert claim is not None and claim.operation.operation_id == older.operation_id


async def test_defer_gives_the_operation_back_until_the_instance_changes(rt, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    instance_id, _ = await deployed(w, workers=1)
    first = await ctl.claim(w.slug, lease_s=30)
    second = await ctl.claim(w.slug, lease_s=30)
    assert first is not None and second is not None
    deferred = await ctl.defer(second.operation.operation_id, second.lease_token, reason="head not up", delay_s=600)
    assert (deferred.status, deferred.attempt, deferred.claimed_by) == ("pending", 0, None)
    assert deferred.deferred_until is not None
    assert await ctl.claim(w.slug, lease_s=30) is None  # deferred: not offered while nothing changes
    await expect("lease_lost", 409, ctl.complete(second.operation.operation_id, second.lease_token, result={}))
    await ctl.complete(first.operation.operation_id, first.lease_token, result={})  # the instance changes
    again = await ctl.claim(w.slug, lease_s=30)
    assert again is not None and again.operation.operation_id == second.operation.operation_id
    assert again.operation.attempt == 1  # the deferral did not count
    kinds = [e.message for e in await user.timeline(instance_id)]
    assert any("deferred by its controller: head not up" in m for m in kinds)


async def test_heartbeat_keeps_the_claims_lease_and_member_detail_while_running(rt, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    instance_id, _ = await deployed(w, workers=0)
    claim = await ctl.claim(w.slug, lease_s=15)  # the service's default is 30 s
    assert claim is not None and claim.operation.lease_s == 15
    before = datetime.now(UTC)
    op: Operation = await ctl.heartbeat(claim.operation.operation_id, claim.lease_token, message="installing")
    assert op.lease_s == 15
    assert op.lease_expires_at is not None and op.lease_expires_at < before + timedelta(seconds=25)
    member_id = claim.operation.target_member_id
    assert member_id is not None
    await ctl.report_member(member_id, detail={"port": 7000})  # while the add runs
    (member,) = await user.members(instance_id)
    assert (member.status, member.detail) == ("starting", {"port": 7000})
    op = await ctl.heartbeat(claim.operation.operation_id, claim.lease_token, lease_s=60)
    assert op.lease_s == 60  # a heartbeat that names a length changes it


async def test_a_planned_drain_never_degrades_and_decommission_drops_runtime_detail(rt, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    instance_id, _ = await deployed(w, workers=2)
    adapter = FakeSlurm()  # no role order in this manifest: the head may go first
    loop = ReconcileLoop(ctl, app_slug=w.slug, controller=adapter, lease_s=10, poll_interval_s=0.1)
    await drive(loop, await status_is(w, instance_id, "running"))
    worker = next(m for m in await user.members(instance_id) if m.component_key == "slurmd")
    drain = await user.request_operation(instance_id, "drain", member_id=worker.member_id, params={"deadline_s": 30})
    claim = await ctl.claim(w.slug, lease_s=30)
    assert claim is not None and claim.operation.operation_id == drain.operation_id
    assert (await user.instance(instance_id)).status == "running"  # a member draining by plan
    await ctl.complete(drain.operation_id, claim.lease_token, result={})
    members = {m.member_id: m for m in await user.members(instance_id)}
    assert members[worker.member_id].status == "stopped"
    assert (await user.instance(instance_id)).status == "running"  # drained by plan: not a loss
    remove = await user.request_operation(instance_id, "remove", member_id=worker.member_id)
    assert remove.params["drained"] is True  # the controller need not drain it again

    await ctl.report_instance(instance_id, runtime_detail={"url": "http://10.0.0.1:8000/"})
    await user.decommission(instance_id, "done")
    await drive(loop, await status_is(w, instance_id, "decommissioned", "decommission_failed"))
    inst = await user.instance(instance_id)
    assert inst.status == "decommissioned" and inst.runtime_detail == {}
    assert inst.health.status == "unknown"


async def test_a_preemption_notice_drains_the_member_on_it_once(rt, infra, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    instance_id, (_, a_worker) = await deployed(w, workers=1)
    loop = ReconcileLoop(ctl, app_slug=w.slug, controller=FakeSlurm(), lease_s=10, poll_interval_s=0.1)
    await drive(loop, await status_is(w, instance_id, "running"))
    worker = next(m for m in await user.members(instance_id) if m.allocation_id == a_worker)
    at = datetime.now(UTC)
    notice = al.PreemptionNotice(
        deadline=at + timedelta(minutes=5), reason="reclaim_guarantee", for_allocation_id=uuid.uuid4(), scheduled_at=at
    )
    # signed with allocations' key and consumed from the broker, as allocations' relay publishes it
    await publish(infra.kafka_bootstrap, [w.allocation_event(allocation_id=a_worker, preemption=notice)])

    async def drains() -> list[Operation]:
        return [o for o in await user.operations(instance_id) if o.kind == "drain"]

    (drain,) = await wait_for(drains, 30, "the preemption's drain")
    assert (drain.member_id, drain.params["reason"]) == (worker.member_id, "preemption")
    assert datetime.fromisoformat(drain.params["deadline_at"]) == notice.deadline
    assert 280 < (drain_deadline_s(drain.params) or 0) <= 300  # the SDK bounds the drain by the preemption's
    (entry,) = [e for e in await user.timeline(instance_id) if e.kind == "member.preemption_scheduled"]
    assert entry.data["reason"] == "preemption" and "is drained first" in entry.message

    # the notice again (re-emitted at a newer version) drains nothing more; a planned drain degrades nothing
    await rt.apply(w.allocation_event(allocation_id=a_worker, preemption=notice))
    assert [o.operation_id for o in await drains()] == [drain.operation_id]
    claim = await ctl.claim(w.slug, lease_s=30)
    assert claim is not None and claim.operation.operation_id == drain.operation_id
    assert (await user.instance(instance_id)).status == "running"
    await ctl.complete(drain.operation_id, claim.lease_token, result={"drained": True})
    # a later notice for a member that is drained already: on the timeline, no second drain
    later = notice.model_copy(update={"scheduled_at": datetime.now(UTC)})
    await rt.apply(w.allocation_event(allocation_id=a_worker, preemption=later))
    assert [o.operation_id for o in await drains()] == [drain.operation_id]
    entries = [e for e in await user.timeline(instance_id) if e.kind == "member.preemption_scheduled"]
    assert "not drained: the member is stopped already" in entries[-1].message
    assert (await user.instance(instance_id)).status == "running"


async def test_deferred_operations_are_reoffered_when_a_member_is_reported(rt, world: World) -> None:
    w = world
    ctl = w.controller()
    instance_id, _ = await deployed(w, workers=1)
    first = await ctl.claim(w.slug, lease_s=30)
    assert first is not None
    await ctl.defer(first.operation.operation_id, first.lease_token, reason="later")
    second = await ctl.claim(w.slug, lease_s=30)
    assert second is not None and second.operation.operation_id != first.operation.operation_id
    assert await ctl.claim(w.slug, lease_s=30) is None
    target = second.operation.target_member_id
    assert target is not None
    await ctl.report_member(target, detail={"step": 1})
    again = await ctl.claim(w.slug, lease_s=30)
    assert again is not None and again.operation.operation_id == first.operation.operation_id
    assert uuid.UUID(str(instance_id)) == again.operation.instance_id
