"""Capacity queues (issue 29): operators set tenant queues, tenant admins divide their tenant's share among its
projects, and the views of usage against guarantee, limit and weight.

Every change is checked before anything is written (422 problem+json, nothing half-written), audited and
announced with `capacity_queue.updated` in the same transaction, and wakes the admission runners (a new
guarantee or limit can admit a waiting request). Changes of one tenant's queues of one pool are serialised
(advisory lock), so two admins dividing the same share cannot both pass the sum check, and an If-Match is checked
under that lock (of two admins who read the same version only one writes; a queue without settings is version 0,
so only a write without If-Match creates one).
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from typing import Any, Literal

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import SERVICE, domain
from gpuaas.allocations.models import allocations, capacity_queues
from gpuaas.allocations.queue_usage import COUNTED, GPUS, QUEUED, WAIT_GPUS, WAIT_REASON, WAITS
from gpuaas.allocations.service.common import now, poke_admission
from gpuaas.allocations.service.placement import check_model_offered
from gpuaas.allocations.service.waiting import lock_tenant_pool
from gpuaas.allocations.views import CapacityQueue
from gpuaas.contracts import new_event_id
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import NotFound
from gpuaas.kit.outbox import add_event
from gpuaas.kit.tables import iam_tenants
from gpuaas.kit.versioning import check_version

Scope = Literal["tenant", "project"]
FIGURES = ("guarantee", "limit", "lend_limit", "weight")


async def put_tenant_queue(
    session: AsyncSession,
    principal: Principal,
    tenant_id: uuid.UUID,
    gpu_model: str,
    figures: dict[str, Any],
    *,
    expected_version: int | None = None,
) -> CapacityQueue:
    """An operator sets a tenant's queue of a pool. Its guarantee may not drop below what its projects
    are guaranteed together (else their shares would exceed the tenant's)."""
    await iam.authorize(session, principal, "allocations.queue.operate", tenant_id=tenant_id)
    if (
        await session.execute(select(iam_tenants.c.tenant_id).where(iam_tenants.c.tenant_id == tenant_id))
    ).first() is None:
        raise NotFound("tenant not found", code="tenant_not_found")
    domain.check_queue_figures(**figures)
    await check_model_offered(session, gpu_model)
    await lock_tenant_pool(session, tenant_id, gpu_model)
    before = await _row(session, "tenant", tenant_id, gpu_model)
    check_version(before.version if before else 0, expected_version)
    projects = await _project_queues(session, tenant_id, gpu_model)
    for p in projects:  # the tenant's new figures must still hold each project's as they are
        domain.check_project_share(
            tenant_guarantee=figures["guarantee"],
            tenant_limit=figures["limit"],
            other_projects_guarantee=sum(o.guarantee for o in projects if o.scope_id != p.scope_id),
            guarantee=p.guarantee,
            limit=p.limit,
        )
    await _write(session, principal, before, "tenant", tenant_id, tenant_id, gpu_model, figures)
    return (await _views(session, gpu_model, [("tenant", tenant_id, tenant_id)]))[0]


async def put_project_queue(
    session: AsyncSession,
    principal: Principal,
    project_id: uuid.UUID,
    gpu_model: str,
    figures: dict[str, Any],
    *,
    expected_version: int | None = None,
) -> CapacityQueue:
    """A tenant admin sets a project's queue, inside the tenant's share."""
    await iam.authorize(session, principal, "allocations.queue.manage", project_id=project_id)
    tenant_id = await iam.project_tenant(session, project_id)
    assert tenant_id is not None
    domain.check_queue_figures(**figures)
    await check_model_offered(session, gpu_model)
    await lock_tenant_pool(session, tenant_id, gpu_model)
    before = await _row(session, "project", project_id, gpu_model)
    check_version(before.version if before else 0, expected_version)
    tenant = await _row(session, "tenant", tenant_id, gpu_model)
    others = [p for p in await _project_queues(session, tenant_id, gpu_model) if p.scope_id != project_id]
    domain.check_project_share(
        tenant_guarantee=tenant.guarantee if tenant else 0,
        tenant_limit=tenant.limit if tenant else None,
        other_projects_guarantee=sum(p.guarantee for p in others),
        guarantee=figures["guarantee"],
        limit=figures["limit"],
    )
    await _write(session, principal, before, "project", project_id, tenant_id, gpu_model, figures)
    return (await _views(session, gpu_model, [("project", project_id, tenant_id)]))[0]


async def get_tenant_queue(
    session: AsyncSession, principal: Principal, tenant_id: uuid.UUID, gpu_model: str
) -> CapacityQueue:
    await iam.authorize(session, principal, "allocations.queue.manage", tenant_id=tenant_id)
    return (await _views(session, gpu_model, [("tenant", tenant_id, tenant_id)]))[0]


async def get_project_queue(
    session: AsyncSession, principal: Principal, project_id: uuid.UUID, gpu_model: str
) -> CapacityQueue:
    await iam.authorize(session, principal, "allocations.read", project_id=project_id)
    tenant_id = await iam.project_tenant(session, project_id)
    assert tenant_id is not None
    return (await _views(session, gpu_model, [("project", project_id, tenant_id)]))[0]


async def list_queues(session: AsyncSession, principal: Principal, gpu_model: str | None) -> list[CapacityQueue]:
    """Operators' view: every queue with settings, and every tenant and project holding or waiting for GPUs,
    per pool (tenants first, then their projects)."""
    await iam.authorize(session, principal, "allocations.queue.operate")
    if gpu_model is not None:
        models = [gpu_model]
    else:
        configured = select(capacity_queues.c.gpu_model)
        used = select(allocations.c.gpu_model).where(allocations.c.status.in_(COUNTED))
        models = sorted((await session.execute(configured.union(used))).scalars())
    out: list[CapacityQueue] = []
    for model in models:
        keys: set[tuple[Scope, uuid.UUID, uuid.UUID]] = set()
        rows = await session.execute(
            select(capacity_queues.c.scope, capacity_queues.c.scope_id, capacity_queues.c.tenant_id).where(
                capacity_queues.c.gpu_model == model
            )
        )
        keys.update((r.scope, r.scope_id, r.tenant_id) for r in rows)
        active = await session.execute(
            select(allocations.c.project_id, allocations.c.tenant_id)
            .where(allocations.c.gpu_model == model, allocations.c.status.in_(COUNTED))
            .distinct()
        )
        for r in active:
            keys.update({("tenant", r.tenant_id, r.tenant_id), ("project", r.project_id, r.tenant_id)})
        ordered = sorted(keys, key=lambda k: (str(k[2]), k[0] != "tenant", str(k[1])))
        out.extend(await _views(session, model, ordered))
    return out


async def list_tenant_queues(
    session: AsyncSession, principal: Principal, tenant_id: uuid.UUID, gpu_model: str | None
) -> list[CapacityQueue]:
    """A tenant admin's view: the tenant's queue and its projects' queues of each pool (or of `gpu_model`) where
    the tenant has settings, holds or waits for GPUs (the tenant first, then its projects)."""
    await iam.authorize(session, principal, "allocations.queue.manage", tenant_id=tenant_id)
    configured = select(capacity_queues.c.gpu_model, capacity_queues.c.scope, capacity_queues.c.scope_id).where(
        capacity_queues.c.tenant_id == tenant_id
    )
    active = (
        select(allocations.c.gpu_model, allocations.c.project_id)
        .where(allocations.c.tenant_id == tenant_id, allocations.c.status.in_(COUNTED))
        .distinct()
    )
    if gpu_model is not None:
        configured = configured.where(capacity_queues.c.gpu_model == gpu_model)
        active = active.where(allocations.c.gpu_model == gpu_model)
    keys: dict[str, set[tuple[Scope, uuid.UUID, uuid.UUID]]] = defaultdict(set)
    for model, scope, scope_id in await session.execute(configured):
        keys[model].update({("tenant", tenant_id, tenant_id), (scope, scope_id, tenant_id)})
    for model, project_id in await session.execute(active):
        keys[model].update({("tenant", tenant_id, tenant_id), ("project", project_id, tenant_id)})
    out: list[CapacityQueue] = []
    for model in sorted(keys):
        ordered = sorted(keys[model], key=lambda k: (k[0] != "tenant", str(k[1])))
        out.extend(await _views(session, model, ordered))
    return out


# ------------------------------------------------------------------------------------------------ internals


async def _row(session: AsyncSession, scope: Scope, scope_id: uuid.UUID, gpu_model: str) -> Any | None:
    q = select(capacity_queues).where(
        capacity_queues.c.scope == scope,
        capacity_queues.c.scope_id == scope_id,
        capacity_queues.c.gpu_model == gpu_model,
    )
    return (await session.execute(q)).first()


async def _project_queues(session: AsyncSession, tenant_id: uuid.UUID, gpu_model: str) -> list[Any]:
    q = select(capacity_queues).where(
        capacity_queues.c.scope == "project",
        capacity_queues.c.tenant_id == tenant_id,
        capacity_queues.c.gpu_model == gpu_model,
    )
    return list((await session.execute(q)).all())


async def _write(
    session: AsyncSession,
    principal: Principal,
    before: Any | None,
    scope: Scope,
    scope_id: uuid.UUID,
    tenant_id: uuid.UUID,
    gpu_model: str,
    figures: dict[str, Any],
) -> None:
    values = {name: figures[name] for name in FIGURES}
    stmt = pg_insert(capacity_queues).values(
        queue_id=new_event_id(),
        scope=scope,
        scope_id=scope_id,
        tenant_id=tenant_id,
        gpu_model=gpu_model,
        updated_at=now(),
        **values,
    )
    row = (
        await session.execute(
            stmt.on_conflict_do_update(
                index_elements=["scope", "scope_id", "gpu_model"],
                set_={**values, "version": capacity_queues.c.version + 1, "updated_at": now()},
            ).returning(*capacity_queues.c)
        )
    ).one()
    state = allocation_events.CapacityQueueState(
        queue_id=row.queue_id,
        scope=scope,
        scope_id=scope_id,
        tenant_id=tenant_id,
        project_id=scope_id if scope == "project" else None,
        gpu_model=gpu_model,
        guarantee=row.guarantee,
        limit=row.limit,
        lend_limit=row.lend_limit,
        weight=row.weight,
        version=row.version,
        updated_at=row.updated_at,
    )
    await add_event(
        session, allocation_events.CapacityQueueUpdated.build(data=state, source=SERVICE, actor=principal.actor)
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action=f"allocations.queue.{scope}.set",
        resource_type="capacity_queue",
        resource_id=row.queue_id,
        tenant_id=tenant_id,
        project_id=scope_id if scope == "project" else None,
        before={"gpu_model": gpu_model, **{n: getattr(before, n) for n in FIGURES}} if before else None,
        after={"gpu_model": gpu_model, **values},
    )
    await poke_admission(session, gpu_model)


async def _views(
    session: AsyncSession, gpu_model: str, keys: list[tuple[Scope, uuid.UUID, uuid.UUID]]
) -> list[CapacityQueue]:
    """The queues named by (scope, scope_id, tenant_id), with their settings and the pool's usage now."""
    settings = {
        (r.scope, r.scope_id): r
        for r in (await session.execute(select(capacity_queues).where(capacity_queues.c.gpu_model == gpu_model))).all()
    }
    # One grouped query: what each project holds, and its waiting demand (queued requests and waiting resizes).
    rows = (
        await session.execute(
            select(
                allocations.c.tenant_id,
                allocations.c.project_id,
                WAIT_REASON,
                func.coalesce(func.sum(GPUS).filter(~QUEUED), 0),
                func.count().filter(WAITS),
                func.coalesce(func.sum(WAIT_GPUS).filter(WAITS), 0),
            )
            .where(allocations.c.gpu_model == gpu_model, allocations.c.status.in_(COUNTED))
            .group_by(allocations.c.tenant_id, allocations.c.project_id, WAIT_REASON)
        )
    ).all()
    held: dict[tuple[str, uuid.UUID], int] = defaultdict(int)
    waiting: dict[tuple[str, uuid.UUID], int] = defaultdict(int)
    waiting_gpus: dict[tuple[str, uuid.UUID], int] = defaultdict(int)
    reasons: dict[tuple[str, uuid.UUID], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for tenant_id, project_id, reason, h, n, g in rows:
        for key in (("tenant", tenant_id), ("project", project_id)):
            held[key] += int(h)
            if n:
                waiting[key] += n
                waiting_gpus[key] += int(g)
                reasons[key][reason or "unknown"] += n

    def guarantee(key: tuple[str, uuid.UUID]) -> int:
        s = settings.get(key)
        return s.guarantee if s else 0

    # Borrowing among siblings: what each level holds above its guarantees, lent out of unused guarantees.
    borrowed_by_level = {
        "tenant": sum(max(n - guarantee(k), 0) for k, n in held.items() if k[0] == "tenant"),
        "project": sum(max(n - guarantee(k), 0) for k, n in held.items() if k[0] == "project"),
    }
    out = []
    for scope, scope_id, tenant_id in keys:
        key = (scope, scope_id)
        s = settings.get(key)
        in_use = held.get(key, 0)
        g = s.guarantee if s else 0
        unused = max(g - in_use, 0)
        lendable = unused if s is None or s.lend_limit is None else min(unused, s.lend_limit)
        out.append(
            CapacityQueue(
                queue_id=s.queue_id if s else None,
                scope=scope,
                scope_id=scope_id,
                tenant_id=tenant_id,
                gpu_model=gpu_model,
                guarantee=g,
                limit=s.limit if s else None,
                lend_limit=s.lend_limit if s else None,
                weight=s.weight if s else 1.0,
                version=s.version if s else 0,
                in_use=in_use,
                borrowed=max(in_use - g, 0),
                lent=min(lendable, borrowed_by_level[scope]),
                waiting=waiting.get(key, 0),
                waiting_gpus=waiting_gpus.get(key, 0),
                pending_reasons=dict(reasons.get(key, {})),
            )
        )
    return out
