"""How the routers run one use case: a read in a session, a change in one transaction, and a change of a
versioned resource guarded by If-Match that answers the new version as the `ETag` once committed
(ARCHITECTURE §11)."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Response
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime.service import InstanceView, OperationView
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.auth import Principal
from gpuaas.kit.versioning import set_etag

T = TypeVar("T")
VersionedT = TypeVar("VersionedT", InstanceView, OperationView)


async def read(kit: KitRuntime, use_case: Callable[[AsyncSession], Awaitable[T]]) -> T:
    async with kit.sessions() as session:
        return await use_case(session)


async def change(kit: KitRuntime, use_case: Callable[[AsyncSession], Awaitable[T]]) -> T:
    """Run `use_case` in one transaction, committed before the answer."""
    async with kit.sessions() as session, session.begin():
        return await use_case(session)


def versioned(response: Response, view: VersionedT) -> VersionedT:
    """The view, with its version as the response's ETag."""
    set_etag(response, view.version)
    return view


async def versioned_call(
    kit: KitRuntime,
    response: Response,
    use_case: Callable[..., Awaitable[VersionedT]],
    principal: Principal,
    resource_id: uuid.UUID,
    *args: Any,
    expected: int | None,
    **kwargs: Any,
) -> VersionedT:
    """A change guarded by If-Match: `use_case(session, principal, resource_id, *args, **kwargs,
    expected_version=expected)` in one transaction, answering the resource's new version as the ETag."""
    changed = await change(
        kit, lambda session: use_case(session, principal, resource_id, *args, **kwargs, expected_version=expected)
    )
    return versioned(response, changed)
