"""Background loops: the reconciler (lost heartbeats, expired task leases, overdue release clearances) and the
task listener that wakes the agents' long-polls.

Every pass is one short transaction per concern; rows are claimed with `FOR UPDATE SKIP LOCKED`
(or guarded by their current state), so several replicas can run it side by side.
"""

from __future__ import annotations

import asyncpg

from gpuaas.allocations import service
from gpuaas.allocations.runtime import AllocationsRuntime
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


async def reconciler(kit: KitRuntime) -> None:
    await run_periodically(
        kit, "reconcile", kit.settings_as(Settings).reconcile_interval_s, lambda: reconcile_once(kit)
    )


async def listen_for_tasks(kit: KitRuntime) -> None:
    """Background loop: LISTEN allocations_tasks and wake the long-polls of that host. While the listener
    is down (logged, reconnected after 2 s) the long-polls fall back to polling every second."""
    wakeups = kit.state_as(AllocationsRuntime).wakeups
    dsn = to_plain_url(kit.settings.database_url.get_secret_value())

    async def listen() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.add_listener(TASKS_CHANNEL, lambda _c, _p, _ch, payload: wakeups.notify(payload))
            while not conn.is_closed() and not await wait_or_stop(kit.stopping, 5):
                await conn.execute("SELECT 1")
        finally:
            if not conn.is_closed():
                await conn.close()

    await run_periodically(kit, "task_listener", 2.0, listen)
