"""Project service accounts: OAuth clients for `client_credentials`, with scopes; the secret is shown
once (at creation and at each rotation); disabling denies the account everywhere once the event lands."""

from __future__ import annotations

import uuid

from sqlalchemy import Row, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Event, new_event_id
from gpuaas.contracts.events import identity as identity_events
from gpuaas.identity import SERVICE
from gpuaas.identity.credentials import new_secret, token_hash
from gpuaas.identity.models import service_accounts
from gpuaas.identity.service import views
from gpuaas.identity.service.common import emit
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound, Unprocessable


def _view(r: Row) -> views.ServiceAccount:
    return views.ServiceAccount(
        service_account_id=r.service_account_id,
        client_id=str(r.service_account_id),
        tenant_id=r.tenant_id,
        project_id=r.project_id,
        name=r.name,
        scopes=list(r.scopes),
        disabled=r.disabled,
        created_at=r.created_at,
        secret_rotated_at=r.secret_rotated_at,
    )


def _with_secret(r: Row, secret: str) -> views.ServiceAccountWithSecret:
    return views.ServiceAccountWithSecret(**_view(r).model_dump(), client_secret=secret)


async def _emit(session: AsyncSession, principal: Principal, row: Row, event_type: type[Event]) -> None:
    state = identity_events.ServiceAccountState(
        service_account_id=row.service_account_id,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        name=row.name,
        scopes=list(row.scopes),
        disabled=row.disabled,
    )
    await emit(
        session,
        event_type.build(
            subject=row.service_account_id,
            data=state,
            source=SERVICE,
            tenant_id=row.tenant_id,
            project_id=row.project_id,
            actor=principal.actor,
        ),
    )


async def create_service_account(
    session: AsyncSession, principal: Principal, *, project_id: uuid.UUID, name: str, scopes: list[str]
) -> views.ServiceAccountWithSecret:
    await iam.authorize(session, principal, "identity.service_account.manage", project_id=project_id)
    unknown = sorted(set(scopes) - set(iam.SCOPE_ACTIONS))
    if unknown or not scopes:
        raise Unprocessable(
            f"unknown scopes {unknown}; known: {sorted(iam.SCOPE_ACTIONS)}" if unknown else "give at least one scope",
            code="invalid_scope",
        )
    tenant_id = await iam.project_tenant(session, project_id)
    taken = (
        await session.execute(
            select(service_accounts.c.service_account_id).where(
                service_accounts.c.project_id == project_id, service_accounts.c.name == name
            )
        )
    ).first()
    if taken:
        raise Conflict(f"a service account named {name!r} exists in this project", code="service_account_name_taken")
    secret = new_secret("sa")
    row = (
        await session.execute(
            insert(service_accounts)
            .values(
                service_account_id=new_event_id(),
                tenant_id=tenant_id,
                project_id=project_id,
                name=name,
                scopes=sorted(set(scopes)),
                secret_hash=token_hash(secret),
            )
            .returning(*service_accounts.c)
        )
    ).one()
    await _emit(session, principal, row, identity_events.ServiceAccountCreated)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="identity.service_account.create",
        resource_type="service_account",
        resource_id=row.service_account_id,
        tenant_id=tenant_id,
        project_id=project_id,
        after={"name": name, "scopes": list(row.scopes)},
    )
    return _with_secret(row, secret)


async def list_service_accounts(
    session: AsyncSession, principal: Principal, project_id: uuid.UUID
) -> list[views.ServiceAccount]:
    await iam.authorize(session, principal, "identity.service_account.read", project_id=project_id)
    rows = await session.execute(
        select(service_accounts).where(service_accounts.c.project_id == project_id).order_by(service_accounts.c.name)
    )
    return [_view(r) for r in rows]


async def _locked(session: AsyncSession, principal: Principal, sa_id: uuid.UUID) -> Row:
    row = (
        await session.execute(
            select(service_accounts).where(service_accounts.c.service_account_id == sa_id).with_for_update()
        )
    ).first()
    if row is None:
        raise NotFound("service account not found", code="service_account_not_found")
    await iam.authorize(session, principal, "identity.service_account.manage", project_id=row.project_id)
    return row


async def _update(session: AsyncSession, sa_id: uuid.UUID, **values: object) -> Row:
    return (
        await session.execute(
            update(service_accounts)
            .where(service_accounts.c.service_account_id == sa_id)
            .values(**values)
            .returning(*service_accounts.c)
        )
    ).one()


async def rotate_service_account_secret(
    session: AsyncSession, principal: Principal, sa_id: uuid.UUID
) -> views.ServiceAccountWithSecret:
    """A new secret replaces the old one at once, and the tokens issued with the old one are revoked in
    every service (`service_account.secret_rotated`: tokens issued before it are refused)."""
    await _locked(session, principal, sa_id)
    secret = new_secret("sa")
    row = await _update(session, sa_id, secret_hash=token_hash(secret), secret_rotated_at=func.clock_timestamp())
    await _emit(session, principal, row, identity_events.ServiceAccountSecretRotated)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="identity.service_account.rotate_secret",
        resource_type="service_account",
        resource_id=sa_id,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        reason="secret rotated",
    )
    return _with_secret(row, secret)


async def set_service_account_disabled(
    session: AsyncSession, principal: Principal, sa_id: uuid.UUID, disabled: bool
) -> views.ServiceAccount:
    """Disabling denies the account in every service as soon as they apply the event (its tokens too)."""
    before = await _locked(session, principal, sa_id)
    if before.disabled == disabled:
        return _view(before)
    row = await _update(session, sa_id, disabled=disabled)
    await _emit(
        session,
        principal,
        row,
        identity_events.ServiceAccountDisabled if disabled else identity_events.ServiceAccountUpdated,
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="identity.service_account.disable" if disabled else "identity.service_account.enable",
        resource_type="service_account",
        resource_id=sa_id,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        before={"disabled": before.disabled},
        after={"disabled": disabled},
    )
    return _view(row)
