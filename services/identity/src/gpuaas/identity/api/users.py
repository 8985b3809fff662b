"""Users: self-service (`/me`, one's own sessions) and account administration (tenant users, platform
accounts, disabling and enabling, operators)."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request, Response

from gpuaas.identity.api.deps import action, session_id_of
from gpuaas.identity.api.schemas import (
    Granted,
    Me,
    PlatformAdminAdd,
    PlatformUserCreate,
    SessionInfo,
    User,
    UserCreate,
    UserCreated,
    UserStatus,
)
from gpuaas.identity.service import sessions, users
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal, bearer_token

router = APIRouter()


# ------------------------------------------------------------------------------------ self service


@router.get("/me", response_model=Me, tags=["users"])
async def me(kit: Kit, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session:
        return await users.me(session, principal)


@router.get("/sessions", response_model=list[SessionInfo], tags=["sessions"])
async def list_sessions(request: Request, kit: Kit, principal: CurrentPrincipal) -> Any:
    """Your own sessions (newest first); `current` marks the one this token belongs to."""
    raw = bearer_token(request) or ""
    async with kit.sessions() as session:
        return await sessions.list_sessions(session, principal, current=session_id_of(raw))


@router.delete("/sessions/{session_id}", status_code=204, tags=["sessions"])
async def revoke_session(kit: Kit, session_id: uuid.UUID, principal: CurrentPrincipal) -> Response:
    async with kit.sessions() as session, session.begin():
        await sessions.revoke_own_session(session, principal, session_id)
    return Response(status_code=204)


# ------------------------------------------------------------------------------ administration


@router.post(
    "/tenants/{tenant_id}/users",
    response_model=UserCreated,
    status_code=201,
    tags=["users"],
    **action("identity.member.manage"),
)
async def create_user(kit: Kit, tenant_id: uuid.UUID, body: UserCreate, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        return await users.create_tenant_user(
            session,
            principal,
            tenant_id=tenant_id,
            email=body.email,
            password=body.password,
            display_name=body.display_name,
            role=body.role,
            project_id=body.project_id,
            email_verified=body.email_verified,
        )


@router.get("/tenants/{tenant_id}/users", response_model=list[User], tags=["users"], **action("identity.user.read"))
async def list_users(kit: Kit, tenant_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session:
        return await users.list_tenant_users(session, principal, tenant_id)


@router.post(
    "/users", response_model=UserCreated, status_code=201, tags=["users"], **action("identity.platform_admin.manage")
)
async def create_platform_user(kit: Kit, body: PlatformUserCreate, principal: CurrentPrincipal) -> Any:
    """A platform account with no tenant (operators-to-be)."""
    async with kit.sessions() as session, session.begin():
        return await users.create_platform_user(
            session, principal, email=body.email, password=body.password, display_name=body.display_name
        )


@router.post("/users/{user_id}/disable", response_model=UserStatus, tags=["users"], **action("identity.user.manage"))
async def disable_user(kit: Kit, user_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    """Disable an account: its sessions are revoked and every service denies it once the event lands."""
    async with kit.sessions() as session, session.begin():
        return await users.set_user_status(session, principal, user_id, "disabled")


@router.post("/users/{user_id}/enable", response_model=UserStatus, tags=["users"], **action("identity.user.manage"))
async def enable_user(kit: Kit, user_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        return await users.set_user_status(session, principal, user_id, "active")


@router.post(
    "/platform-admins",
    response_model=Granted,
    status_code=201,
    tags=["users"],
    **action("identity.platform_admin.manage"),
)
async def add_platform_admin(kit: Kit, body: PlatformAdminAdd, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        return await users.grant_platform_admin(session, principal, user_id=body.user_id)
