"""Project GPU quotas: set, read, and the check every GPU-holding change makes."""

from __future__ import annotations

import uuid

from sqlalchemy import func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import SERVICE, domain
from gpuaas.allocations.metrics import refused
from gpuaas.allocations.models import allocations, quotas
from gpuaas.allocations.views import Quota
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, Forbidden


async def project_gpu_usage(session: AsyncSession, project_id: uuid.UUID) -> int:
    used = await session.execute(
        select(
            func.coalesce(
                func.sum(func.greatest(allocations.c.gpu_count, func.coalesce(allocations.c.target_gpu_count, 0))), 0
            )
        ).where(allocations.c.project_id == project_id, allocations.c.status.in_(list(domain.HOLDS_CAPACITY)))
    )
    return int(used.scalar_one())


async def check_quota(session: AsyncSession, project_id: uuid.UUID, extra: int, *, count_refusal: bool = True) -> None:
    """Serialise GPU-holding changes of one project (advisory lock), then check its quota. `count_refusal`:
    count a refusal in the metrics (not when the request waits in the queue instead)."""
    if (await session.execute(select(quotas.c.max_gpus).where(quotas.c.project_id == project_id))).first() is None:
        return  # no quota: nothing to serialise
    await session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:p, 7))"), {"p": str(project_id)})
    q = (await session.execute(select(quotas.c.max_gpus).where(quotas.c.project_id == project_id))).one()
    used = await project_gpu_usage(session, project_id)
    if used + extra > q.max_gpus:
        if count_refusal:
            refused(session, "quota_exceeded")
        raise Conflict(
            f"the project's GPU quota is {q.max_gpus}; {used} are in use and {extra} more were asked for",
            code="quota_exceeded",
            quota=q.max_gpus,
            in_use=used,
            requested=extra,
        )


async def set_quota(session: AsyncSession, principal: Principal, project_id: uuid.UUID, max_gpus: int) -> Quota:
    await iam.authorize(session, principal, "allocations.quota.manage", project_id=project_id)
    tenant_id = await iam.project_tenant(session, project_id)
    before = (
        await session.execute(select(quotas.c.max_gpus).where(quotas.c.project_id == project_id).with_for_update())
    ).first()
    # A quota is the operator's cap on a project: a tenant admin may tighten it (any value is tighter than
    # none), never loosen it, else the cap would bind no one who can reach it (docs/decisions.md).
    if before is not None and max_gpus > before[0] and not await iam.is_platform_admin(session, principal):
        raise Forbidden(
            f"only a platform operator can raise a project's GPU quota (now {before[0]})", code="quota_raise_forbidden"
        )
    stmt = pg_insert(quotas).values(project_id=project_id, tenant_id=tenant_id, max_gpus=max_gpus)
    await session.execute(
        stmt.on_conflict_do_update(
            index_elements=["project_id"], set_={"max_gpus": max_gpus, "version": quotas.c.version + 1}
        )
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.quota.set",
        resource_type="quota",
        resource_id=project_id,
        tenant_id=tenant_id,
        project_id=project_id,
        before={"max_gpus": before[0]} if before else None,
        after={"max_gpus": max_gpus},
    )
    return await get_quota(session, principal, project_id)  # as a reader sees it (authorized as one)


async def get_quota(session: AsyncSession, principal: Principal, project_id: uuid.UUID) -> Quota:
    await iam.authorize(session, principal, "allocations.read", project_id=project_id)
    row = (await session.execute(select(quotas.c.max_gpus).where(quotas.c.project_id == project_id))).first()
    return Quota(
        project_id=project_id,
        max_gpus=row[0] if row else None,
        gpus_in_use=await project_gpu_usage(session, project_id),
    )
