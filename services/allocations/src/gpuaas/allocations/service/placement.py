"""Placement: free GPU capacity per host and the reservation of GPUs on one host, never double-booked."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import domain
from gpuaas.allocations.models import gpu_assignments, hosts
from gpuaas.contracts.enums import CapacityShape
from gpuaas.contracts.events.allocations import HostStatus
from gpuaas.kit.errors import Conflict, Unprocessable


async def _capacities(session: AsyncSession, host_ids: list[uuid.UUID] | None = None) -> list[domain.HostCapacity]:
    q = select(hosts.c.host_id, hosts.c.name, hosts.c.status, hosts.c.host_class, hosts.c.gpus)
    if host_ids is not None:
        q = q.where(hosts.c.host_id.in_(host_ids))
    host_rows = (await session.execute(q)).all()
    used_rows = await session.execute(select(gpu_assignments.c.host_id, gpu_assignments.c.gpu_index))
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


async def _place(
    session: AsyncSession,
    *,
    shape: CapacityShape,
    model: str,
    count: int | None,
    host_class: str | None,
    alloc_id: uuid.UUID,
) -> tuple[Any, list[int]]:
    """Pick a host and reserve GPUs on it. Host rows are locked one at a time and capacity is
    re-read under the lock, so concurrent creates queue and never double-book (the primary key
    of gpu_assignments is the last line of defence)."""
    snapshot = await _capacities(session)
    if not any(model in h.gpu_indices_by_model for h in snapshot if h.status != HostStatus.decommissioned):
        known = sorted({m for h in snapshot for m in h.gpu_indices_by_model})
        raise Unprocessable(
            f"no host offers GPU model {model!r}; known models: {', '.join(known) or 'none'}", code="unknown_gpu_model"
        )
    want = count or 1
    # Pass 1 skips hosts other requests hold, so concurrent creates spread over hosts; pass 2 waits.
    for skip_locked in (True, False):
        for cand in domain.candidates(snapshot, shape=shape, model=model, count=want, host_class=host_class):
            lock = select(hosts).where(hosts.c.host_id == cand.host_id).with_for_update(skip_locked=skip_locked)
            host = (await session.execute(lock)).first()
            if host is None or host.status != HostStatus.ready:
                continue
            fresh = (await _capacities(session, [cand.host_id]))[0]
            picked = domain.pick_gpus(fresh, shape=shape, model=model, count=want)
            if picked is None or (shape is CapacityShape.baremetal and count and count != len(picked)):
                continue
            await session.execute(
                insert(gpu_assignments),
                [{"host_id": host.host_id, "gpu_index": i, "allocation_id": alloc_id} for i in picked],
            )
            return host, picked
        snapshot = await _capacities(session)
    what = f"a whole {model} host" if shape is CapacityShape.baremetal else f"{want} free {model} GPUs on one host"
    raise Conflict(
        f"no ready host has {what}" + (f" in class {host_class!r}" if host_class else ""), code="insufficient_capacity"
    )
