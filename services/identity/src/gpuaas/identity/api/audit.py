"""The audit trail: every service's audit records, searched by operators and tenant admins."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Query, Request, Response

from gpuaas.identity.api.deps import action
from gpuaas.identity.api.schemas import AuditPage
from gpuaas.identity.service import audit_store
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal
from gpuaas.kit.paging import set_next_link

router = APIRouter()


@router.get("/audit", response_model=AuditPage, tags=["audit"], **action("identity.audit.read"))
async def list_audit(
    kit: Kit,
    request: Request,
    response: Response,
    principal: CurrentPrincipal,
    tenant_id: uuid.UUID | None = None,
    project_id: uuid.UUID | None = None,
    actor_id: str | None = Query(None, max_length=200),
    resource_type: str | None = Query(None, max_length=100),
    resource_id: str | None = Query(None, max_length=200),
    action: str | None = Query(None, max_length=100),
    service_name: str | None = Query(None, alias="service", max_length=50),
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0),
    cursor: str | None = Query(None, max_length=512),
) -> Any:
    """Operators see every record; tenant admins their tenant's (pass `tenant_id`). Newest first.
    `?limit=&cursor=` pages (`Link: <...>; rel="next"` while more follow); `offset` still works."""
    query = audit_store.AuditQuery(
        tenant_id=tenant_id,
        project_id=project_id,
        actor_id=actor_id,
        resource_type=resource_type,
        resource_id=resource_id,
        action=action,
        service=service_name,
        since=since,
        until=until,
        limit=limit,
        offset=offset,
        cursor=cursor,
    )
    async with kit.sessions() as session:
        page, next_cursor = await audit_store.list_audit(session, principal, query)
    set_next_link(request, response, next_cursor)
    return page
