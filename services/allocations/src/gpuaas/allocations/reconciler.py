"""Background reconciler: lost heartbeats, expired task leases, overdue release clearances.

Every pass is one short transaction per concern; rows are claimed with `FOR UPDATE SKIP LOCKED`
(or guarded by their current state), so several replicas can run it side by side.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gpuaas.allocations import service
from gpuaas.kit.logging import get_logger

log = get_logger(__name__)


async def reconcile_once(kit: Any) -> None:
    s = kit.settings
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


async def reconciler(kit: Any) -> None:
    while True:
        try:
            await reconcile_once(kit)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("reconcile_failed")
        await asyncio.sleep(kit.settings.reconcile_interval_s)
