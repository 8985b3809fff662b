"""App-runtime's background loop: requeue member operations whose lease expired (their controller crashed
or hung), and grant as forced the release clearances that are overdue.

Each concern is one short transaction; rows are claimed with `FOR UPDATE SKIP LOCKED`, so several replicas
can run it side by side. `run_periodically` stops it at shutdown and survives a failed round.
"""

from __future__ import annotations

from gpuaas.app_runtime import service
from gpuaas.app_runtime.settings import Settings
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.logging import get_logger
from gpuaas.kit.loops import run_periodically

log = get_logger(__name__)

# Leases expired per round; a full batch means more are due at once.
LEASE_BATCH = 100


async def reconcile_once(kit: KitRuntime) -> bool:
    """One round; True when more expired leases are waiting."""
    settings = kit.settings_as(Settings)
    async with kit.sessions() as session, session.begin():
        requeued = await service.expire_leases(session, limit=LEASE_BATCH)
    async with kit.sessions() as session, session.begin():
        forced = await service.overdue_releases(session, settings.release_clearance_timeout_s)
    if requeued or forced:
        log.info("reconciled", requeued=requeued, forced_clearances=forced)
    return requeued >= LEASE_BATCH


async def reconciler(kit: KitRuntime) -> None:
    await run_periodically(
        kit, "reconcile", kit.settings_as(Settings).reconcile_interval_s, lambda: reconcile_once(kit)
    )
