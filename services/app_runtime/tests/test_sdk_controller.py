"""The SDK's controller toolkit against the real app-runtime (real Postgres, broker, HTTP): per-role handlers,
the typed config, `TemporaryError` retried inside the lease, `member_detail` sent with the completion,
progress on the operation, stored state, and reconcile on a timer and on change (not on every idle poll)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from gpuaas.kit.testing import wait_for
from gpuaas.sdk import ApiError, ReconcileLoop
from gpuaas.sdk.controller import (
    Backoff,
    Controller,
    OperationContext,
    PermanentError,
    ReconcileContext,
    TemporaryError,
    on,
)

from .conftest import INPUTS, World
from .fake_controller import drive
from .test_runtime import deployed, status_is

pytestmark = pytest.mark.integration


class Typed(Controller):
    config_schema = INPUTS
    reconcile_every_s = 0.6

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None, int]] = []
        self.flaky_left = 2
        self.reconciles: list[tuple[uuid.UUID, str]] = []
        self.partitions: list[str] = []

    @on("add", role="slurmctld")
    async def add_ctld(self, ctx: OperationContext) -> dict[str, Any]:
        self.calls.append(("add", ctx.role, ctx.attempt))
        config = await ctx.config()
        self.partitions.append(config.partition)  # typed: an attribute, not a dict lookup
        await ctx.progress("starting slurmctld", 50)
        await (await ctx.state()).update(lambda d: d.update(ctld=str(ctx.operation.allocation_id)))
        ctx.member_detail.update(daemon="slurmctld", port=6817)
        return {"role": "ctld"}

    @on("add", role="slurmd")
    async def add_worker(self, ctx: OperationContext) -> dict[str, Any]:
        self.calls.append(("add", ctx.role, ctx.attempt))
        if "ctld" not in (await ctx.state()).data:
            raise TemporaryError("slurmctld not up yet", delay=0.1)
        if self.flaky_left > 0:
            self.flaky_left -= 1
            raise TemporaryError("munge not ready", delay=0.1)
        ctx.member_detail["node"] = f"n-{ctx.operation.allocation_id}"
        return {"role": "slurmd"}

    @on("drain")
    async def no_drain(self, ctx: OperationContext) -> dict[str, Any]:
        raise PermanentError("no draining here")

    async def reconcile(self, ctx: ReconcileContext) -> None:
        self.reconciles.append((ctx.instance_id, ctx.reason))


async def test_roles_typed_config_retries_member_detail_and_timers(rt, world: World) -> None:
    w = world
    user, ctl = w.user(w.admin), w.controller()
    iid, (a_ctl, a_w1) = await deployed(w)
    adapter = Typed()
    loop = ReconcileLoop(
        ctl,
        app_slug=w.slug,
        controller=adapter,
        lease_s=10,
        poll_interval_s=0.05,
        watch_every_s=0.2,
        backoff=Backoff(base_s=0.05, cap_s=0.2),
        max_concurrent_operations=1,  # the worker's add waits for the head's by TemporaryError (order: test_ordering)
    )
    await drive(loop, await status_is(w, iid, "running"))

    assert adapter.partitions == ["gpu"]
    worker_calls = [c for c in adapter.calls if c[1] == "slurmd"]
    assert worker_calls[-1][2] >= 2  # retried in the same claim after TemporaryError, then succeeded
    members = {m.component_key: m for m in await user.members(iid)}
    assert members["slurmctld"].detail == {"daemon": "slurmctld", "port": 6817}  # member_detail was sent
    assert members["slurmd"].detail == {"node": f"n-{a_w1}"}
    ops = await user.operations(iid)
    assert all(o.status == "succeeded" for o in ops)
    assert (await ctl.controller_state(iid))["state"] == {"ctld": str(a_ctl)}
    timeline = [e.message for e in await user.timeline(iid)]
    assert any("starting slurmctld" in m for m in timeline)  # progress reached the timeline
    assert any("retrying" in m and "munge not ready" in m for m in timeline)

    # Reconcile: once on change/operation, then on the timer, not on every idle poll (0.05 s here). Run until
    # the timer has fired a few times (a loaded machine may take seconds to start the loop), then compare
    # counts over the time it ran, not over a fixed sleep.
    adapter.reconciles.clear()
    idle_before = loop.metrics.claim_polls.labels("idle")._value.get()
    started = time.monotonic()
    task = asyncio.create_task(loop.run())
    await wait_for(lambda: sum(r[0] == iid for r in adapter.reconciles) >= 3, 60, "reconciles on the timer")
    loop.stop()
    await asyncio.wait_for(task, 10)
    ran_s = time.monotonic() - started
    mine = [r for r in adapter.reconciles if r[0] == iid]
    idle = loop.metrics.claim_polls.labels("idle")._value.get() - idle_before
    assert len(mine) <= ran_s / 0.6 + 3, (ran_s, mine)  # ~ every 0.6 s (plus one on start)
    assert idle >= 2 * len(mine), (idle, mine)  # polls every 0.05 s: far more polls than reconciles

    # A permanent error fails the operation at once, naming why; a kind without a handler says so.
    worker = members["slurmd"]
    await user.request_operation(iid, "drain", member_id=worker.member_id)

    async def drain_failed() -> bool:
        return any(o.kind == "drain" and o.status == "failed" for o in await user.operations(iid))

    await drive(loop, drain_failed)
    drain = next(o for o in await user.operations(iid) if o.kind == "drain")
    assert drain.error == "no draining here"
    with pytest.raises(ApiError):
        await w.controller(w.sa_other).controller_state(iid)


async def test_temporary_errors_give_up_after_the_bound(rt, world: World) -> None:
    w = world
    iid, _ = await deployed(w, workers=0)

    class NeverReady(Controller):
        async def add(self, ctx: OperationContext) -> dict[str, Any]:
            raise TemporaryError("key not installed yet", delay=0.05)

    loop = ReconcileLoop(
        w.controller(),
        app_slug=w.slug,
        controller=NeverReady(),
        lease_s=10,
        poll_interval_s=0.05,
        max_temporary_retries=3,
    )

    async def failed() -> bool:
        return any(o.status == "failed" for o in await w.user(w.admin).operations(iid))

    await drive(loop, failed)
    op = (await w.user(w.admin).operations(iid))[0]
    assert op.error == "gave up after 4 tries: key not installed yet"
    assert loop.metrics.temporary_retries._value.get() == 3


async def test_harness_runs_a_controller_in_process(rt, world: World) -> None:
    from gpuaas.sdk.controller.harness import Harness, Team, wait

    w = world
    iid, _ = await deployed(w, workers=0)
    team = Team(str(w.tenant), str(w.project), w.user(w.admin), {"service_account_id": str(w.sa)}, w.controller())
    h = Harness("http://127.0.0.1:9", "unused")  # only `running` here: the team is this test's world
    adapter = Typed()
    async with h.running(adapter, team, w.slug, watch_every_s=0.2) as loop:

        async def running() -> bool:
            return (await team.user.instance(iid)).status == "running"

        await wait(running, "instance running", timeout_s=30)
    assert not loop.running and [o.kind for o in loop.handled] == ["add"]
    assert any(r[0] == iid for r in adapter.reconciles)
    await h.aclose()
