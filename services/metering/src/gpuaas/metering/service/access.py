"""Who may read which metering rows: one named project (authorized), or every project the caller sees."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import ColumnElement
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.kit import iam
from gpuaas.kit.auth import Principal


async def readable(
    session: AsyncSession, principal: Principal, project_column: Any, project_id: uuid.UUID | None
) -> ColumnElement[bool] | None:
    """The filter on `project_column` for a read: the named project once the caller may read it, else the
    projects the caller may read (None: all of them, an operator)."""
    if project_id is not None:
        await iam.authorize(session, principal, "metering.usage.read", project_id=project_id)
        return project_column == project_id
    visible = await iam.visible_project_ids(session, principal)
    return None if visible is None else project_column.in_(visible)
