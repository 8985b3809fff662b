"""Placement: free GPU capacity per host and the reservation of GPUs on one host, never double-booked.

Candidates come from `host_capacity` (per host and GPU model: total and assigned, kept exact by
triggers, see migration allocations_0005), read best fit first in small batches, so the cost of a
create does not grow with the number of allocations. The chosen host's row is then locked and that
one host's GPU list and assignments are re-read under the lock before GPUs are inserted: the table
only steers the choice, the lock and gpu_assignments' primary key keep GPUs from being double-booked.

Tenancy: a host whose driver does not isolate tenants (`isolates_tenants` false) takes an allocation
only while no other tenant holds GPUs on it, unless an operator allowed sharing (`shared_tenancy_allowed`).
That is checked under the host lock too, so two tenants racing for one such host cannot both land on it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import exists, insert, literal, select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import domain
from gpuaas.allocations.metrics import refused
from gpuaas.allocations.models import allocations, gpu_assignments, host_capacity, hosts
from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events.allocations import HostStatus
from gpuaas.kit.errors import Conflict, Unprocessable

_BATCH = 32  # candidate hosts read per query; most creates take the first


async def capacities(
    session: AsyncSession, host_ids: list[uuid.UUID], *, host_rows: list[Any] | None = None
) -> list[domain.HostCapacity]:
    """Exact capacity of these hosts (their GPU lists and assignments), read by host id only
    (`host_rows`: the hosts' rows when the caller has just read them, e.g. under its lock)."""
    if host_rows is None:
        q = select(hosts.c.host_id, hosts.c.name, hosts.c.status, hosts.c.host_class, hosts.c.gpus)
        host_rows = list((await session.execute(q.where(hosts.c.host_id.in_(host_ids)))).all())
    used_rows = await session.execute(
        select(gpu_assignments.c.host_id, gpu_assignments.c.gpu_index).where(gpu_assignments.c.host_id.in_(host_ids))
    )
    used: dict[uuid.UUID, set[int]] = {}
    for r in used_rows:
        used.setdefault(r.host_id, set()).add(r.gpu_index)
    out = []
    for h in host_rows:
        by_model: dict[str, list[int]] = {}
        for g in h.gpus:
            by_model.setdefault(g["model"], []).append(g["index"])
        out.append(
            domain.HostCapacity(
                h.host_id, h.name, h.status, h.host_class, by_model, frozenset(used.get(h.host_id, set()))
            )
        )
    return out


async def _other_tenant_on(session: AsyncSession, host_id: uuid.UUID, tenant_id: uuid.UUID) -> bool:
    """Whether another tenant holds GPUs on the host (an allocation not yet released or failed)."""
    q = (
        select(gpu_assignments.c.gpu_index)
        .join(allocations, allocations.c.allocation_id == gpu_assignments.c.allocation_id)
        .where(gpu_assignments.c.host_id == host_id, allocations.c.tenant_id != tenant_id)
        .limit(1)
    )
    return (await session.execute(q)).first() is not None


async def _candidate_ids(
    session: AsyncSession,
    *,
    shape: CapacityShape,
    model: str,
    count: int,
    host_class: str | None,
    container_only: bool = False,
) -> AsyncIterator[uuid.UUID]:
    """Ready hosts that (by host_capacity) can take the request, best fit first (fewest free GPUs
    of the model left over, then name) as domain.candidates orders them, read in batches."""
    free = (host_capacity.c.total - host_capacity.c.used).label("free")
    q = (
        select(host_capacity.c.host_id, hosts.c.name, free)
        .join(hosts, hosts.c.host_id == host_capacity.c.host_id)
        .where(host_capacity.c.gpu_model == model, hosts.c.status == HostStatus.ready)
    )
    if host_class:
        q = q.where(hosts.c.host_class == host_class)
    if container_only:
        q = q.where(hosts.c.driver == "container")
    if shape is CapacityShape.baremetal:
        other = host_capacity.alias("other")
        q = q.where(
            host_capacity.c.used == 0,
            host_capacity.c.total > 0,
            ~exists().where(other.c.host_id == host_capacity.c.host_id, other.c.gpu_model != model),
        )
    else:
        q = q.where(free >= count)
    after: tuple[int, str] | None = None
    while True:
        page = (
            q if after is None else q.where(tuple_(free, hosts.c.name) > tuple_(literal(after[0]), literal(after[1])))
        )
        rows = (await session.execute(page.order_by(free, hosts.c.name).limit(_BATCH))).all()
        for r in rows:
            yield r.host_id
        if len(rows) < _BATCH:
            return
        after = (rows[-1].free, rows[-1].name)


async def _unknown_model(session: AsyncSession, model: str) -> None:
    offered = select(host_capacity.c.host_id).join(hosts, hosts.c.host_id == host_capacity.c.host_id)
    offered = offered.where(
        host_capacity.c.gpu_model == model, host_capacity.c.total > 0, hosts.c.status != HostStatus.decommissioned
    )
    if (await session.execute(offered.limit(1))).first() is not None:
        return
    known = (
        await session.execute(select(host_capacity.c.gpu_model).distinct().order_by(host_capacity.c.gpu_model))
    ).scalars()
    refused(session, "unknown_gpu_model")
    raise Unprocessable(
        f"no host offers GPU model {model!r}; known models: {', '.join(known) or 'none'}", code="unknown_gpu_model"
    )


async def reserve_on(
    session: AsyncSession,
    host_id: uuid.UUID,
    *,
    shape: CapacityShape,
    model: str,
    count: int | None,
    host_class: str | None,
    alloc_id: uuid.UUID,
    tenant_id: uuid.UUID,
    skip_locked: bool = False,
    container_only: bool = False,
    prefer: list[int] | None = None,
) -> tuple[Any, list[int]] | None:
    """Reserve GPUs on this one host if it can take the request now: its row locked, its tenancy and capacity
    re-read under the lock, then the GPUs inserted (gpu_assignments' primary key is the last defence). None when
    it cannot (locked by another request with `skip_locked`, not ready, another tenant, full). `prefer`: the
    GPUs an admission plan picked, taken when they are all still free."""
    want = count or 1
    lock = select(hosts).where(hosts.c.host_id == host_id).with_for_update(skip_locked=skip_locked)
    host = (await session.execute(lock)).first()
    if host is None or host.status != HostStatus.ready or (container_only and host.driver != "container"):
        return None
    sharing_matters = not (host.isolates_tenants or host.shared_tenancy_allowed)
    if not domain.tenancy_allows(
        isolates_tenants=host.isolates_tenants,
        shared_tenancy_allowed=host.shared_tenancy_allowed,
        other_tenants_present=sharing_matters and await _other_tenant_on(session, host_id, tenant_id),
    ):
        raise TenancyRefused
    fresh = (await capacities(session, [host_id], host_rows=[host]))[0]
    if not domain.candidates([fresh], shape=shape, model=model, count=want, host_class=host_class):
        return None
    picked = domain.pick_gpus(fresh, shape=shape, model=model, count=want)
    if prefer and shape is CapacityShape.gpu_slice and len(prefer) == want and set(prefer) <= set(fresh.free(model)):
        picked = sorted(prefer)
    if picked is None or (shape is CapacityShape.baremetal and count and count != len(picked)):
        return None
    await session.execute(
        insert(gpu_assignments),
        [{"host_id": host.host_id, "gpu_index": i, "allocation_id": alloc_id} for i in picked],
    )
    return host, picked


class TenancyRefused(Exception):
    """The host does not isolate tenants and another tenant holds GPUs on it."""


async def check_model_offered(session: AsyncSession, model: str) -> None:
    """422 `unknown_gpu_model` unless some host that is not decommissioned offers the model."""
    await _unknown_model(session, model)


async def place(
    session: AsyncSession,
    *,
    shape: CapacityShape,
    model: str,
    count: int | None,
    host_class: str | None,
    alloc_id: uuid.UUID,
    tenant_id: uuid.UUID,
    container_only: bool = False,
    count_refusal: bool = True,
) -> tuple[Any, list[int]]:
    """Pick a host and reserve GPUs on it. Host rows are locked one at a time and capacity is
    re-read under the lock, so concurrent creates queue and never double-book (the primary key
    of gpu_assignments is the last line of defence). `container_only`: a runtime was asked for, so
    only hosts with the container driver qualify. `count_refusal`: count a refusal in the metrics (not
    when the caller queues the request instead)."""
    want = count or 1
    any_candidate = False
    tenancy_refused = False
    # Pass 1 skips hosts other requests hold, so concurrent creates spread over hosts; pass 2 waits.
    for skip_locked in (True, False):
        candidates = _candidate_ids(
            session, shape=shape, model=model, count=want, host_class=host_class, container_only=container_only
        )
        async for host_id in candidates:
            any_candidate = True
            try:
                placed = await reserve_on(
                    session,
                    host_id,
                    shape=shape,
                    model=model,
                    count=count,
                    host_class=host_class,
                    alloc_id=alloc_id,
                    tenant_id=tenant_id,
                    skip_locked=skip_locked,
                )
            except TenancyRefused:
                tenancy_refused = True
                continue
            if placed is not None:
                return placed
    if not any_candidate and not container_only:  # is the model offered anywhere? (422 rather than 409)
        await _unknown_model(session, model)
    what = f"a whole {model} host" if shape is CapacityShape.baremetal else f"{want} free {model} GPUs on one host"
    if count_refusal:
        refused(session, "insufficient_capacity")
    raise Conflict(
        f"no ready {'container ' if container_only else ''}host has {what}"
        + (f" in class {host_class!r}" if host_class else "")
        + (" (hosts that do not isolate tenants are in use by another tenant)" if tenancy_refused else ""),
        code="insufficient_capacity",
    )
