"""Project service accounts: created, listed, secret rotated, disabled and enabled by project admins."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter

from gpuaas.identity.api.deps import action
from gpuaas.identity.api.schemas import ServiceAccount, ServiceAccountCreate, ServiceAccountWithSecret
from gpuaas.identity.service import service_accounts
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal

router = APIRouter(tags=["service accounts"])
MANAGE = action("identity.service_account.manage")


@router.post(
    "/projects/{project_id}/service-accounts", response_model=ServiceAccountWithSecret, status_code=201, **MANAGE
)
async def create_service_account(
    kit: Kit, project_id: uuid.UUID, body: ServiceAccountCreate, principal: CurrentPrincipal
) -> Any:
    """A project service account (OAuth client for `client_credentials`); the secret is shown once."""
    async with kit.sessions() as session, session.begin():
        return await service_accounts.create_service_account(
            session, principal, project_id=project_id, name=body.name, scopes=body.scopes
        )


@router.get(
    "/projects/{project_id}/service-accounts",
    response_model=list[ServiceAccount],
    **action("identity.service_account.read"),
)
async def list_service_accounts(kit: Kit, project_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session:
        return await service_accounts.list_service_accounts(session, principal, project_id)


@router.post("/service-accounts/{service_account_id}/rotate-secret", response_model=ServiceAccountWithSecret, **MANAGE)
async def rotate_secret(kit: Kit, service_account_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        return await service_accounts.rotate_service_account_secret(session, principal, service_account_id)


@router.post("/service-accounts/{service_account_id}/disable", response_model=ServiceAccount, **MANAGE)
async def disable_service_account(kit: Kit, service_account_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        return await service_accounts.set_service_account_disabled(session, principal, service_account_id, True)


@router.post("/service-accounts/{service_account_id}/enable", response_model=ServiceAccount, **MANAGE)
async def enable_service_account(kit: Kit, service_account_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        return await service_accounts.set_service_account_disabled(session, principal, service_account_id, False)
