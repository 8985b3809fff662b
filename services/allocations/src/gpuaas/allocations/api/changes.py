"""The one ending of every change of an allocation: commit, wake the host's agent, answer the new ETag."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Response
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations.runtime import AllocationsRuntime
from gpuaas.allocations.views import AllocationChange
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.versioning import set_etag

BodyT = TypeVar("BodyT")


async def commit_change(
    kit: KitRuntime,
    response: Response,
    change: Callable[[AsyncSession], Awaitable[AllocationChange[BodyT]]],
) -> BodyT:
    """Run `change` (a use case, in one transaction), then, once committed, wake the agent of the host that
    has new work and answer the allocation's new version as the `ETag`."""
    async with kit.sessions() as session, session.begin():
        changed = await change(session)
    kit.state_as(AllocationsRuntime).wakeups.notify(changed.host_id)
    set_etag(response, changed.version)
    return changed.body
