"""Events allocations consumes from app-runtime (in the consumer's transaction; no network).

- access grants: the instance controller's public key becomes SSH grants on the listed allocations;
- members: a projection of which allocations carry live app members (release saga);
- release clearance: app-runtime stopped the members on an allocation: the release proceeds.
"""

from __future__ import annotations

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import service
from gpuaas.allocations.models import app_members
from gpuaas.contracts.events import app_runtime as ar
from gpuaas.kit.subscriptions import Subscriptions

subscriptions = Subscriptions()


@subscriptions.on(ar.AccessGrantRequested, ar.AccessGrantUpdated)
async def on_access_grant(session: AsyncSession, e: ar.AccessGrantRequested) -> None:
    await service.apply_access_grant(session, e.data, revoked=False, actor=e.actor)


@subscriptions.on(ar.AccessGrantRevoked)
async def on_access_grant_revoked(session: AsyncSession, e: ar.AccessGrantRevoked) -> None:
    await service.apply_access_grant(session, e.data, revoked=True, actor=e.actor)


@subscriptions.on(ar.MemberAdded, ar.MemberUpdated, ar.MemberTombstoned)
async def on_member(session: AsyncSession, e: ar.MemberAdded) -> None:
    d = e.data
    values = {
        "member_id": d.member_id,
        "allocation_id": d.allocation_id,
        "status": str(d.status),
        "tombstoned": d.tombstoned or e.type == "member.tombstoned",
        "version": d.version,
    }
    stmt = pg_insert(app_members).values(values)
    await session.execute(
        stmt.on_conflict_do_update(
            index_elements=["member_id"],
            set_={k: stmt.excluded[k] for k in values if k != "member_id"},
            where=app_members.c.version <= stmt.excluded.version,
        )
    )


@subscriptions.on(ar.ReleaseClearanceGranted)
async def on_release_clearance(session: AsyncSession, e: ar.ReleaseClearanceGranted) -> None:
    d = e.data
    note = f"app-runtime stopped {len(d.stopped_member_ids)} member(s)" + (" (forced)" if d.forced else "")
    await service.clearance_granted(session, d.allocation_id, forced=d.forced, note=note)
