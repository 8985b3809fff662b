"""Reading the audit store (every service's `audit.recorded` events, stored by handlers.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.identity.models import audit_records
from gpuaas.identity.service import views
from gpuaas.kit import iam, paging
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Forbidden, Unprocessable

_ENTRY_FIELDS = list(views.AuditEntry.model_fields)


@dataclass(frozen=True)
class AuditQuery:
    """Filters of an audit search (all optional); `until` is exclusive."""

    tenant_id: uuid.UUID | None = None
    project_id: uuid.UUID | None = None
    actor_id: str | None = None
    resource_type: str | None = None
    resource_id: str | None = None
    action: str | None = None
    service: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    limit: int = 100
    offset: int = 0
    cursor: str | None = None  # kit.paging: from the previous page's Link rel="next"


async def list_audit(
    session: AsyncSession, principal: Principal, query: AuditQuery
) -> tuple[views.AuditPage, str | None]:
    """Operators see every record; tenant admins their tenant's (they must name it). Newest first: one
    page (keyset on occurred_at, seq after `cursor`, then `offset` if given) and the next page's cursor."""
    for name, value in (("since", query.since), ("until", query.until)):
        if value is not None and value.tzinfo is None:
            raise Unprocessable(f"{name} needs a UTC offset", code="naive_datetime")
    if not await iam.is_platform_admin(session, principal):
        if query.tenant_id is None:
            raise Forbidden("pass the tenant_id whose audit trail you administer", code="tenant_required")
        await iam.authorize(session, principal, "identity.audit.read", tenant_id=query.tenant_id)
    c = audit_records.c
    where = [
        column == value
        for column, value in (
            (c.tenant_id, query.tenant_id),
            (c.project_id, query.project_id),
            (c.actor_id, query.actor_id),
            (c.resource_type, query.resource_type),
            (c.resource_id, query.resource_id),
            (c.action, query.action),
            (c.service, query.service),
        )
        if value is not None
    ]
    if query.since is not None:
        where.append(c.occurred_at >= query.since)
    if query.until is not None:
        where.append(c.occurred_at < query.until)
    page = paging.PageRequest(limit=query.limit, cursor=query.cursor)
    stmt = paging.keyset(
        select(*(c[name] for name in _ENTRY_FIELDS), c.seq).where(*where), [c.occurred_at, c.seq], page
    )
    rows, next_cursor = paging.split(
        (await session.execute(stmt.offset(query.offset))).all(), page, lambda r: (r.occurred_at, r.seq)
    )
    total = (await session.execute(select(func.count()).select_from(audit_records).where(*where))).scalar_one()
    items = [views.AuditEntry(**{k: r._mapping[k] for k in _ENTRY_FIELDS}) for r in rows]
    return views.AuditPage(items=items, total=total), next_cursor
