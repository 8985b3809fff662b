"""Access credentials of app instances: the SSH key pair whose public half allocations installs (the access
grant, kept on the allocations of the live members) and whose private half only the instance's controller
fetches.

Keys are made and sealed by custody BEFORE the transaction that records them (`issue_credential`), and
opened AFTER the one that reads them (`open_credential`): Vault is a network call, never made inside a
database transaction.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import ColumnElement, Row, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime.custody import Custody, generate_key_pair
from gpuaas.app_runtime.models import credentials
from gpuaas.app_runtime.service.common import (
    audit_on,
    authorized_instance,
    controller_instance,
    emit,
    grant_state,
    live_members,
    now,
    readable_instance,
    timeline,
)
from gpuaas.app_runtime.service.views import (
    ControllerCredential,
    CredentialView,
    InstanceView,
    IssuedCredential,
    SealedCredential,
    from_row,
    sealed_of,
)
from gpuaas.contracts import Actor, new_event_id
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events import app_runtime as app_runtime_events
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound

ACTIVE = "active"


async def issue_credential(custody: Custody) -> IssuedCredential:
    """A new key pair, its private half sealed by custody (outside any transaction)."""
    credential_id = new_event_id()
    key_pair = generate_key_pair(f"gpuaas-app-{credential_id}")
    sealed = await custody.seal(credential_id, key_pair.private_openssh)
    return IssuedCredential(credential_id=credential_id, key_pair=key_pair, sealed=sealed)


async def open_credential(custody: Custody, found: SealedCredential) -> ControllerCredential:
    """The credential with its private key (outside any transaction)."""
    private_key = await custody.open(found.credential.credential_id, found.sealed)
    return ControllerCredential(**_fields(found.credential), private_key=private_key)


def _fields(view: CredentialView) -> dict[str, Any]:
    return {name: getattr(view, name) for name in CredentialView.__dataclass_fields__}


async def member_allocations(session: AsyncSession, instance_id: uuid.UUID) -> list[str]:
    """The allocations of the instance's live members: where its access grant must be installed."""
    return sorted({str(m.allocation_id) for m in await live_members(session, instance_id)})


async def insert_credential(
    session: AsyncSession,
    inst: InstanceView,
    issued: IssuedCredential,
    allocation_ids: list[str],
    *,
    actor: Actor,
    rotated_from: uuid.UUID | None = None,
) -> CredentialView:
    """Record an issued credential as the instance's active one and request its access grant."""
    row = (
        await session.execute(
            insert(credentials)
            .values(
                credential_id=issued.credential_id,
                instance_id=inst.instance_id,
                tenant_id=inst.tenant_id,
                project_id=inst.project_id,
                public_key=issued.key_pair.public_openssh,
                fingerprint=issued.key_pair.fingerprint,
                status=ACTIVE,
                allocation_ids=allocation_ids,
                version=1,
                rotated_from=rotated_from,
                **issued.sealed.columns(),
            )
            .returning(*credentials.c)
        )
    ).one()
    cred = from_row(CredentialView, row)
    await emit(session, app_runtime_events.AccessGrantRequested, grant_state(cred), actor)
    return cred


async def _active_row(session: AsyncSession, instance_id: uuid.UUID, *, lock: bool = False) -> Row[Any] | None:
    stmt = select(credentials).where(credentials.c.instance_id == instance_id, credentials.c.status == ACTIVE)
    if lock:
        stmt = stmt.with_for_update()
    return (await session.execute(stmt)).first()


async def _revoke(session: AsyncSession, where: ColumnElement[bool], actor: Actor) -> list[CredentialView]:
    rows = await session.execute(
        update(credentials)
        .where(where)
        .values(status="revoked", revoked_at=now(), version=credentials.c.version + 1)
        .returning(*credentials.c)
    )
    revoked = [from_row(CredentialView, r) for r in rows]
    for cred in revoked:
        await emit(session, app_runtime_events.AccessGrantRevoked, grant_state(cred, "revoked"), actor)
    return revoked


async def sync_grant(session: AsyncSession, instance_id: uuid.UUID, actor: Actor) -> None:
    """Keep the access grant's allocations equal to the allocations of the live members."""
    row = await _active_row(session, instance_id, lock=True)
    if row is None:
        return
    wanted = await member_allocations(session, instance_id)
    if wanted == sorted(row.allocation_ids):
        return
    updated = (
        await session.execute(
            update(credentials)
            .where(credentials.c.credential_id == row.credential_id)
            .values(allocation_ids=wanted, version=credentials.c.version + 1)
            .returning(*credentials.c)
        )
    ).one()
    await emit(session, app_runtime_events.AccessGrantUpdated, grant_state(from_row(CredentialView, updated)), actor)


async def revoke_credentials(session: AsyncSession, instance_id: uuid.UUID, actor: Actor) -> None:
    """Revoke the instance's active credential (it is gone): the grant is withdrawn from its allocations."""
    where = (credentials.c.instance_id == instance_id) & (credentials.c.status == ACTIVE)
    for cred in await _revoke(session, where, actor):
        await timeline(
            session,
            instance_id,
            "credential.revoked",
            f"access credential {cred.fingerprint} revoked",
            actor,
            credential_id=cred.credential_id,
        )


async def public_credential(session: AsyncSession, principal: Principal, instance_id: uuid.UUID) -> CredentialView:
    """The active credential's public half, for whoever may read the instance."""
    await readable_instance(session, principal, instance_id)
    row = await _active_row(session, instance_id)
    if row is None:
        raise NotFound("the instance has no active access credential", code="credential_not_found")
    return from_row(CredentialView, row)


async def authorize_rotation(session: AsyncSession, principal: Principal, instance_id: uuid.UUID) -> None:
    """Refuse a rotation the caller may not do before a key is made for it."""
    await authorized_instance(session, principal, instance_id, "apps.credential.rotate", lock=False)


async def rotate_credential(
    session: AsyncSession, principal: Principal, instance_id: uuid.UUID, issued: IssuedCredential
) -> CredentialView:
    """Replace the active credential by `issued`; the old one's grant is revoked."""
    inst = await authorized_instance(session, principal, instance_id, "apps.credential.rotate")
    if inst.status == InstanceStatus.decommissioned:
        raise Conflict("the instance is decommissioned", code="instance_not_live")
    actor = principal.actor
    old = await _active_row(session, instance_id, lock=True)
    new = await insert_credential(
        session,
        inst,
        issued,
        await member_allocations(session, instance_id),
        actor=actor,
        rotated_from=old.credential_id if old else None,
    )
    if old is not None:
        await _revoke(session, credentials.c.credential_id == old.credential_id, actor)
    await timeline(
        session,
        instance_id,
        "credential.rotated",
        f"access credential rotated to {new.fingerprint}",
        actor,
        credential_id=new.credential_id,
    )
    await audit_on(
        session,
        principal,
        "apps.credential.rotate",
        new,
        before={"fingerprint": old.fingerprint if old else None},
        after={"fingerprint": new.fingerprint},
    )
    return new


async def credential_for_controller(
    session: AsyncSession, principal: Principal, instance_id: uuid.UUID
) -> SealedCredential:
    """The active credential, sealed, for the instance's controller (the fetch is audited)."""
    await controller_instance(session, principal, instance_id)
    row = await _active_row(session, instance_id)
    if row is None:
        raise NotFound("the instance has no active access credential", code="credential_not_found")
    cred = from_row(CredentialView, row)
    await audit_on(session, principal, "apps.credential.fetch", cred, after={"fingerprint": cred.fingerprint})
    return SealedCredential(credential=cred, sealed=sealed_of(row))
