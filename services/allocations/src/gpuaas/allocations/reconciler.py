"""Background reconciler: lost heartbeats, expired task leases, overdue release clearances.

Every pass is one short transaction per concern; rows are claimed with `FOR UPDATE SKIP LOCKED`
(or guarded by their current state), so several replicas can run it side by side.
"""

from __future__ import annotations

from gpuaas.allocations import service
from gpuaas.allocations.settings import Settings
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.logging import get_logger
from gpuaas.kit.loops import run_periodically

log = get_logger(__name__)


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
