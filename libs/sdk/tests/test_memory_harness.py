"""The controller loop's semantics on the in-memory harness (no stack): role ordering as the platform applies it,
`Defer`, drain before remove with its deadline, progress keeping the loop's lease length, member detail while an
operation runs, several operations at once (never two on one member), and reconcile results at INFO, rate-limited.
The same rules against the real service: services/app_runtime/tests/test_ordering.py."""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gpuaas.sdk.controller import Controller, Defer, OperationContext, ReconcileContext, on
from gpuaas.sdk.controller.memory import InMemoryHarness

ORDERED = {"slug": "ray", "version": "1.0", "roles": [{"key": "head"}, {"key": "worker", "after": ["head"]}]}
UNORDERED = {"slug": "ray", "version": "1.0", "roles": [{"key": "head"}, {"key": "worker"}]}


class HeadWorkers(Controller):
    """Records what it did, in order; a worker add needs the head up (defers otherwise)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.head_up = False

    @on("add", role="head")
    async def add_head(self, ctx: OperationContext) -> dict[str, Any]:
        self.log.append("add head")
        self.head_up = True
        return {}

    @on("add", role="worker")
    async def add_worker(self, ctx: OperationContext) -> dict[str, Any]:
        if not self.head_up:
            ctx.defer("no head yet")
        self.log.append("add worker")
        return {}

    @on("remove")
    async def remove(self, ctx: OperationContext) -> dict[str, Any]:
        self.log.append(f"remove {ctx.role}")
        if ctx.role == "head":
            self.head_up = False
        return {"teardown_verified": True}


async def test_workers_requested_before_the_head_come_up_after_it() -> None:
    h = InMemoryHarness(HeadWorkers(), manifest=ORDERED)
    iid = h.deploy({}, worker=1)  # a worker's add first ...
    h.add(iid, "worker")
    head_op = h.add(iid, "head")  # ... then the head's
    handled = await h.settle()
    assert handled[0] == head_op  # the platform holds the workers back until the head is up
    ctl = h.controller
    assert isinstance(ctl, HeadWorkers)
    assert ctl.log == ["add head", "add worker", "add worker"]
    assert h.instance(iid).status == "running"
    assert all(h.operation(o)["attempt"] == 1 for o in handled)  # nothing retried, nothing deferred


async def test_decommission_removes_the_workers_before_the_head() -> None:
    h = InMemoryHarness(HeadWorkers(), manifest=ORDERED)
    iid = h.deploy({}, head=1, worker=2)
    await h.settle()
    await h.decommission(iid)
    ctl = h.controller
    assert isinstance(ctl, HeadWorkers)
    assert ctl.log[3:] == ["remove worker", "remove worker", "remove head"]
    inst = h.instance(iid)
    assert inst.status == "decommissioned" and inst.runtime_detail == {}


async def test_a_deferred_operation_costs_no_attempt_and_comes_back_when_the_instance_changes() -> None:
    h = InMemoryHarness(HeadWorkers(), manifest=UNORDERED)  # no ordering: the controller defers by itself
    iid = h.deploy({}, worker=1)
    head_op = h.add(iid, "head")
    worker_op = next(o for o in h.operations if o != head_op)
    handled = await h.settle()
    assert handled == [worker_op, head_op, worker_op]  # deferred, then offered again once the head's add finished
    assert h.operation(worker_op)["status"] == "succeeded"
    assert h.operation(worker_op)["attempt"] == 1  # the deferral did not count
    assert h.instance(iid).status == "running"


async def test_a_deferred_operation_waits_while_nothing_changes() -> None:
    class Never(Controller):
        @on("add")
        async def add(self, ctx: OperationContext) -> dict[str, Any]:
            raise Defer("never ready")

    h = InMemoryHarness(Never(), manifest=UNORDERED)
    iid = h.deploy({}, head=1)
    assert len(await h.settle()) == 1  # offered once; not again until something changes
    (op,) = h.pending()
    assert op["status"] == "pending" and op["attempt"] == 0 and op["deferred_until"] is not None
    h.add(iid, "worker")  # a change of the instance: the deferred add is offered again
    assert len(await h.settle()) == 2  # the deferred add again, and the new one (deferred too)


class Draining(Controller):
    def __init__(self, drain_s: float = 0.0) -> None:
        self.drain_s = drain_s
        self.log: list[str] = []

    async def add(self, ctx: OperationContext) -> dict[str, Any]:
        return {}

    async def drain(self, ctx: OperationContext) -> dict[str, Any]:
        self.log.append("drain")
        await asyncio.sleep(self.drain_s)
        self.log.append("drained")
        return {}

    async def remove(self, ctx: OperationContext) -> dict[str, Any]:
        self.log.append("remove")
        return {"teardown_verified": True}


async def test_remove_drains_first_and_a_planned_drain_never_degrades() -> None:
    ctl = Draining()
    h = InMemoryHarness(ctl, manifest=UNORDERED)
    iid = h.deploy({}, head=1, worker=2)
    await h.settle()
    worker = next(m for m in h.members(iid) if m["component_key"] == "worker")
    h.request(uuid.UUID(worker["member_id"]), "drain")
    await h.settle()
    assert worker["status"] == "stopped" and h.instance(iid).status == "running"  # drained by plan: no loss
    op = h.request(uuid.UUID(worker["member_id"]), "remove")
    await h.settle()
    assert h.operation(op)["params"]["drained"] is True  # drained before: the remove does not drain again
    assert ctl.log == ["drain", "drained", "remove"]
    other = next(m for m in h.members(iid) if m["component_key"] == "worker")
    op = h.request(uuid.UUID(other["member_id"]), "remove")
    await h.settle()
    assert ctl.log[3:] == ["drain", "drained", "remove"]
    assert h.operation(op)["result"] == {"teardown_verified": True, "drain": "drained"}


async def test_a_drain_past_its_deadline_does_not_block_the_remove() -> None:
    ctl = Draining(drain_s=30)
    h = InMemoryHarness(ctl, manifest=UNORDERED)
    iid = h.deploy({}, head=1)
    await h.settle()
    (member,) = h.members(iid)
    op = h.request(uuid.UUID(member["member_id"]), "remove", drain_deadline_s=0.2)
    await h.settle()
    assert ctl.log == ["drain", "remove"]  # cut off at its deadline
    assert h.operation(op)["result"]["drain"] == "not drained within 0.2s"
    assert h.operation(op)["status"] == "succeeded"


async def test_a_preemption_drain_runs_until_its_deadline_at() -> None:
    ctl = Draining(drain_s=30)
    h = InMemoryHarness(ctl, manifest=UNORDERED)
    iid = h.deploy({}, head=1)
    await h.settle()
    (member,) = h.members(iid)
    at = (datetime.now(UTC) + timedelta(seconds=0.2)).isoformat()  # a time, as the platform's preemption drain
    op = h.request(uuid.UUID(member["member_id"]), "drain", reason="preemption", deadline_at=at, deadline_s=600)
    await h.settle()
    assert ctl.log == ["drain"]  # cut off at the time, not after deadline_s
    assert h.operation(op)["status"] == "failed" and "deadline" in h.operation(op)["error"]


async def test_progress_keeps_the_lease_length_and_member_detail_shows_while_running() -> None:
    seen: dict[str, Any] = {}

    class Slow(Controller):
        async def add(self, ctx: OperationContext) -> dict[str, Any]:
            await ctx.progress("starting", 10)
            await ctx.update_member_detail(port=7000)
            member = next(
                m for m in h.members(ctx.instance_id) if m["member_id"] == str(ctx.operation.target_member_id)
            )
            seen.update(
                status=member["status"],
                detail=dict(member["detail"]),
                lease=h.operation(ctx.operation.operation_id)["lease_s"],
            )
            ctx.member_detail["ready"] = True
            return {}

    h = InMemoryHarness(Slow(), manifest=UNORDERED, lease_s=15)
    iid = h.deploy({}, head=1)
    await h.settle()
    assert seen == {"status": "starting", "detail": {"port": 7000}, "lease": 15}
    (member,) = h.members(iid)
    assert member["detail"] == {"port": 7000, "ready": True}


async def test_several_operations_at_once_but_never_two_on_one_member() -> None:
    running: set[str] = set()
    most = 0
    three = asyncio.Event()

    class Parallel(Controller):
        async def add(self, ctx: OperationContext) -> dict[str, Any]:
            nonlocal most
            member = str(ctx.operation.target_member_id)
            assert member not in running
            running.add(member)
            most = max(most, len(running))
            if len(running) >= 3:
                three.set()
            async with asyncio.timeout(10):  # fails the test rather than hanging if operations ran one by one
                await three.wait()
            running.discard(member)
            return {}

    h = InMemoryHarness(Parallel(), manifest=UNORDERED, max_concurrent_operations=3, poll_interval_s=0.01)
    iid = h.deploy({}, head=1, worker=4)
    task = asyncio.create_task(h.loop.run())
    try:
        async with asyncio.timeout(20):
            while any(m["status"] != "active" for m in h.members(iid)):
                await asyncio.sleep(0.01)
    finally:
        h.loop.stop()
        await task
    assert most == 3
    assert not any(o["status"] == "failed" for o in h.operations.values())


async def test_reconcile_results_are_logged_at_info_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    class Quiet(Controller):
        async def add(self, ctx: OperationContext) -> dict[str, Any]:
            return {}

        async def reconcile(self, ctx: ReconcileContext) -> None:
            await ctx.report(health={"status": "healthy", "message": "ok"})

    h = InMemoryHarness(Quiet(), manifest=UNORDERED, reconcile_log_every_s=3600)
    iid = h.deploy({}, head=1)
    await h.settle()
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="gpuaas.sdk.controller"):
        for _ in range(3):
            await h.reconcile(iid)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.getMessage().startswith("reconciled")]
    assert [level for level, _ in lines] == [logging.DEBUG] * 3  # settle() already logged this one at INFO
    h.loop.reconcile_log_every_s = 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gpuaas.sdk.controller"):
        await h.reconcile(iid)
    assert [r.getMessage() for r in caplog.records] == [f"reconciled instance={iid} reason=timer"]
