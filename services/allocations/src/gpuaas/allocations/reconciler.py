"""Background loops: the reconciler (lost heartbeats, expired task leases, overdue release clearances,
preemption deadlines), the
task listener that wakes the agents' long-polls (and the admission loop), and the admission loop (issue 29).

Every pass is one short transaction per concern; rows are claimed with `FOR UPDATE SKIP LOCKED`
(or guarded by their current state), so several replicas can run it side by side.
"""

from __future__ import annotations

import asyncio

import asyncpg

from gpuaas.allocations import service
from gpuaas.allocations.runtime import AllocationsRuntime
from gpuaas.allocations.service.admission_runner import pools_waiting, run_cycle
from gpuaas.allocations.service.common import ADMISSION_CHANNEL, now
from gpuaas.allocations.service.preemption import PreemptionConfig, due, stop_due
from gpuaas.allocations.settings import Settings
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.db import to_plain_url
from gpuaas.kit.logging import get_logger
from gpuaas.kit.loops import run_periodically, wait_or_stop

log = get_logger(__name__)
TASKS_CHANNEL = "allocations_tasks"  # the use case that queues a task sends pg_notify on it


async def reconcile_once(kit: KitRuntime) -> None:
    s = kit.settings_as(Settings)
    async with kit.sessions() as session, session.begin():
        await service.mark_lost_hosts(session, timeout_s=s.agent_heartbeat_timeout_s)
    async with kit.sessions() as session, session.begin():
        if await service.requeue_expired_tasks(session):
            log.info("agent_task_leases_expired")
    async with kit.sessions() as session, session.begin():
        for alloc_id in await service.overdue_clearances(session, s.release_clearance_timeout_s):
            await service.clearance_granted(
                session,
                alloc_id,
                forced=True,
                note=f"app-runtime gave no release clearance within {s.release_clearance_timeout_s:.0f}s; "
                "releasing anyway",
            )
    await stop_preempted(kit)


def preemption_config(s: Settings) -> PreemptionConfig:
    return PreemptionConfig(
        enabled=s.preemption_enabled,
        min_runtime_s=s.preemption_min_runtime_s,
        grace_s=s.preemption_grace_s,
        stop_timeout_s=s.preemption_stop_timeout_s,
    )


async def stop_preempted(kit: KitRuntime) -> int:
    """Stop the victims whose preemption deadline passed, one transaction each; how many were stopped."""
    config = preemption_config(kit.settings_as(Settings))
    async with kit.sessions() as session:
        ids = await due(session, now())
    stopped = 0
    for alloc_id in ids:
        async with kit.sessions() as session, session.begin():
            stopped += await stop_due(session, alloc_id, now(), config) is not None
    return stopped


async def reconciler(kit: KitRuntime) -> None:
    await run_periodically(
        kit, "reconcile", kit.settings_as(Settings).reconcile_interval_s, lambda: reconcile_once(kit)
    )


async def listen_for_tasks(kit: KitRuntime) -> None:
    """Background loop: LISTEN allocations_tasks and wake the long-polls of that host, and LISTEN
    allocations_admission and wake the admission loop. While the listener is down (logged, reconnected after
    2 s) the long-polls fall back to polling every second and admission to its resync timer."""
    state = kit.state_as(AllocationsRuntime)
    wakeups = state.wakeups
    dsn = to_plain_url(kit.settings.database_url.get_secret_value())

    async def listen() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.add_listener(TASKS_CHANNEL, lambda _c, _p, _ch, payload: wakeups.notify(payload))
            await conn.add_listener(ADMISSION_CHANNEL, lambda _c, _p, _ch, _payload: state.admission_poke.set())
            while not conn.is_closed() and not await wait_or_stop(kit.stopping, 5):
                await conn.execute("SELECT 1")
        finally:
            if not conn.is_closed():
                await conn.close()

    await run_periodically(kit, "task_listener", 2.0, listen)


async def admit_once(kit: KitRuntime) -> int:
    """One admission cycle of every pool with waiting requests (one transaction each); requests admitted."""
    wakeups = kit.state_as(AllocationsRuntime).wakeups
    config = preemption_config(kit.settings_as(Settings))
    async with kit.sessions() as session:
        models = await pools_waiting(session)
    admitted = 0
    for model in models:
        async with kit.sessions() as session, session.begin():
            result = await run_cycle(session, model, config if config.enabled else None)
        for host_id in result.hosts:
            wakeups.notify(host_id)
        admitted += len(result.admitted)
    return admitted


async def admission_loop(kit: KitRuntime) -> None:
    """Background loop: an admission cycle at every wake-up and at least every `admission_resync_s`."""
    poke = kit.state_as(AllocationsRuntime).admission_poke
    resync_s = kit.settings_as(Settings).admission_resync_s
    while not kit.stopping.is_set():
        poke.clear()  # a wake-up that arrives during the cycle runs the next one
        try:
            await admit_once(kit)
        except Exception as exc:
            log.warning("admission_failed", error=f"{type(exc).__name__}: {exc}")
        woken = asyncio.ensure_future(poke.wait())
        stopped = asyncio.ensure_future(kit.stopping.wait())
        try:
            await asyncio.wait({woken, stopped}, timeout=resync_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            stopped.cancel()
