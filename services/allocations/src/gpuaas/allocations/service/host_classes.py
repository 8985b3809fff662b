"""Host classes (operators): the default runtime of the allocations placed on a class's hosts and the
resource figures per GPU their containers are limited to; and the runtime and limits of a new placement."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import SERVICE, domain
from gpuaas.allocations.models import host_classes
from gpuaas.allocations.service.runtimes import resolve_runtime
from gpuaas.contracts.events.allocations import RuntimeRef
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal

CONTAINER = "container"


def class_view(row: Any) -> dict[str, Any]:
    return {
        "name": row.name,
        "default_runtime": row.default_runtime,
        "cpus_per_gpu": row.cpus_per_gpu,
        "memory_mb_per_gpu": row.memory_mb_per_gpu,
        "pids_limit": row.pids_limit,
        "version": row.version,
        "updated_at": row.updated_at,
    }


async def list_host_classes(session: AsyncSession) -> list[dict[str, Any]]:
    return [class_view(r) for r in await session.execute(select(host_classes).order_by(host_classes.c.name))]


async def put_host_class(
    session: AsyncSession,
    principal: Principal,
    name: str,
    *,
    default_runtime: str | None,
    cpus_per_gpu: float | None,
    memory_mb_per_gpu: int | None,
    pids_limit: int,
) -> dict[str, Any]:
    """Create or replace a class's figures (audited). The default runtime is checked for its form here
    and resolved at each create, so a later retirement in the catalog takes effect at once."""
    await iam.authorize(session, principal, "allocations.host.manage")
    if default_runtime is not None:
        domain.parse_runtime_spec(default_runtime)
    before = (await session.execute(select(host_classes).where(host_classes.c.name == name))).first()
    values = {
        "default_runtime": default_runtime,
        "cpus_per_gpu": cpus_per_gpu,
        "memory_mb_per_gpu": memory_mb_per_gpu,
        "pids_limit": pids_limit,
    }
    stmt = pg_insert(host_classes).values(name=name, **values)
    row = (
        await session.execute(
            stmt.on_conflict_do_update(
                index_elements=["name"],
                set_={**values, "version": host_classes.c.version + 1, "updated_at": func.now()},
            ).returning(*host_classes.c)
        )
    ).one()
    view = class_view(row)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.host_class.put",
        resource_type="host_class",
        resource_id=name,
        before=None if before is None else {k: getattr(before, k) for k in values},
        after=values,
    )
    return view


async def runtime_and_limits(
    session: AsyncSession, host: Any, *, requested: str | None, tenant_id: uuid.UUID, gpu_count: int
) -> tuple[RuntimeRef | None, dict[str, Any] | None]:
    """The runtime (requested, else the class default, else the platform default) and the limits of an
    allocation placed on `host`; both None on a host without the container driver."""
    if host.driver != CONTAINER:
        return None, None
    cls = None
    if host.host_class:
        cls = (await session.execute(select(host_classes).where(host_classes.c.name == host.host_class))).first()
    default = cls.default_runtime if cls is not None and cls.default_runtime else domain.DEFAULT_RUNTIME
    runtime = await resolve_runtime(session, requested or default, tenant_id)
    return runtime, await limits_for(session, host, gpu_count=gpu_count, cls=cls)


async def limits_for(session: AsyncSession, host: Any, *, gpu_count: int, cls: Any = None) -> dict[str, Any] | None:
    if host.driver != CONTAINER:
        return None
    if cls is None and host.host_class:
        cls = (await session.execute(select(host_classes).where(host_classes.c.name == host.host_class))).first()
    figures = domain.ClassFigures(cls.cpus_per_gpu, cls.memory_mb_per_gpu, cls.pids_limit) if cls is not None else None
    return domain.allocation_limits(
        figures,
        gpu_count=gpu_count,
        host_cpus=host.cpu_count,
        host_memory_mb=host.memory_mb,
        host_gpus=len(host.gpus or []),
    )
