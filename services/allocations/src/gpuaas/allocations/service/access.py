"""SSH access to allocations: personal keys, grants to project members, app-runtime's controller
keys, the authorized keys an agent installs, and who may open the browser terminal."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import and_, delete, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations import SERVICE, domain
from gpuaas.allocations.models import allocations, hosts, platform_keys, ssh_grants, ssh_keys
from gpuaas.allocations.service.common import enqueue_task, load_allocation, now, record_timeline
from gpuaas.allocations.views import AllocationChange, SshHostKey, SshKey, TerminalTarget
from gpuaas.contracts import Actor, new_event_id
from gpuaas.contracts.agent import SyncSshKeysTask
from gpuaas.contracts.enums import AllocationStatus, MembershipScope
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.contracts.events.allocations import SshGrantState
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, Forbidden, NotFound, Problem, Unprocessable
from gpuaas.kit.outbox import add_event
from gpuaas.kit.secrets_at_rest import keyring_of, reseal_column
from gpuaas.kit.tables import iam_memberships, iam_users
from gpuaas.kit.versioning import check_version


async def may_ssh(session: AsyncSession, user_id: uuid.UUID, tenant_id: uuid.UUID, project_id: uuid.UUID) -> bool:
    """Whether a person's keys may be on an allocation of this project: not disabled (identity's projection),
    and still a member of the project, of its tenant, or of the platform."""
    status = (await session.execute(select(iam_users.c.status).where(iam_users.c.user_id == user_id))).scalar()
    if status == "disabled":
        return False
    return await _is_member(session, user_id, tenant_id, project_id, platform_counts=True)


async def authorized_keys(session: AsyncSession, alloc: Any) -> list[str]:
    """The owner's personal keys and the active grants' keys: what the agent installs. A person who was
    disabled or left the project has none here (the agent also closes their open sessions)."""
    keys: list[str] = []
    if alloc.owner_user_id and await may_ssh(session, alloc.owner_user_id, alloc.tenant_id, alloc.project_id):
        keys += (
            (
                await session.execute(
                    select(ssh_keys.c.public_key)
                    .where(ssh_keys.c.user_id == alloc.owner_user_id)
                    .order_by(ssh_keys.c.created_at)
                )
            )
            .scalars()
            .all()
        )
    grants = await session.execute(
        select(ssh_grants.c.public_key, ssh_grants.c.user_id)
        .where(ssh_grants.c.allocation_id == alloc.allocation_id, ssh_grants.c.status == "active")
        .order_by(ssh_grants.c.created_at)
    )
    for g in grants.all():
        if g.user_id is None or await may_ssh(session, g.user_id, alloc.tenant_id, alloc.project_id):
            keys.append(g.public_key)
    return list(dict.fromkeys(keys))


async def access_of_user_changed(session: AsyncSession, user_id: uuid.UUID, why: str) -> None:
    """Identity changed a person's standing (disabled, re-enabled, a membership revoked or changed): every
    live allocation carrying their keys gets its key list again, in this transaction. Grants to a person who
    may no longer SSH into that project are revoked for good; the owner's own keys come back if the owner
    does (the allocation is theirs). The agent closes the sessions of the keys it removes."""
    actor = Actor.system(SERVICE)
    ended: dict[uuid.UUID, Any] = {}
    grants = await session.execute(
        select(ssh_grants)
        .where(ssh_grants.c.user_id == user_id, ssh_grants.c.status == "active", ssh_grants.c.origin == "user")
        .with_for_update()
    )
    for grant in grants.all():
        if await may_ssh(session, user_id, grant.tenant_id, grant.project_id):
            continue
        await _revoke_grant_row(session, grant, actor)
        await audit.record(
            session,
            service=SERVICE,
            actor=actor,
            action="allocations.ssh_grant.revoke",
            resource_type="ssh_grant",
            resource_id=grant.grant_id,
            tenant_id=grant.tenant_id,
            project_id=grant.project_id,
            reason=why,
        )
        ended[grant.allocation_id] = None
    owned = await session.execute(
        select(allocations).where(allocations.c.owner_user_id == user_id, allocations.c.status.in_(SYNCABLE))
    )
    for alloc in owned.all():
        if not await may_ssh(session, user_id, alloc.tenant_id, alloc.project_id):
            ended[alloc.allocation_id] = alloc
        else:
            await sync_keys(session, alloc)  # a re-enabled owner gets their keys back
    for alloc_id, row in ended.items():
        alloc = row or (await session.execute(select(allocations).where(allocations.c.allocation_id == alloc_id))).one()
        if alloc.status not in SYNCABLE:
            continue
        await record_timeline(
            session,
            alloc_id,
            "access",
            "info",
            f"SSH access of user {user_id} ended ({why}): their keys are removed and their open sessions closed",
        )
        await sync_keys(session, alloc)


async def add_ssh_key(session: AsyncSession, principal: Principal, *, name: str, public_key: str) -> SshKey:
    if principal.is_service_account:
        raise Forbidden("personal SSH keys belong to users", code="users_only")
    line, fp = domain.parse_public_key(public_key)
    exists = (
        await session.execute(
            select(ssh_keys.c.key_id).where(ssh_keys.c.user_id == principal.subject, ssh_keys.c.fingerprint == fp)
        )
    ).first()
    if exists:
        raise Conflict("you already registered this key", code="ssh_key_exists", key_id=str(exists[0]))
    key_id = new_event_id()
    row = (
        await session.execute(
            insert(ssh_keys)
            .values(key_id=key_id, user_id=principal.subject, name=name, public_key=line, fingerprint=fp)
            .returning(*ssh_keys.c)
        )
    ).one()
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.ssh_key.add",
        resource_type="ssh_key",
        resource_id=key_id,
        after={"name": name, "fingerprint": fp},
    )
    await _sync_owner_allocations(session, principal.subject)
    return SshKey.model_validate(row, from_attributes=True)


async def list_ssh_keys(session: AsyncSession, principal: Principal) -> list[SshKey]:
    rows = await session.execute(
        select(ssh_keys).where(ssh_keys.c.user_id == principal.subject).order_by(ssh_keys.c.created_at)
    )
    return [SshKey.model_validate(r, from_attributes=True) for r in rows]


async def delete_ssh_key(session: AsyncSession, principal: Principal, key_id: uuid.UUID) -> None:
    row = (
        await session.execute(
            delete(ssh_keys)
            .where(ssh_keys.c.key_id == key_id, ssh_keys.c.user_id == principal.subject)
            .returning(ssh_keys.c.fingerprint)
        )
    ).first()
    if row is None:
        raise NotFound("SSH key not found", code="ssh_key_not_found")
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.ssh_key.delete",
        resource_type="ssh_key",
        resource_id=key_id,
        before={"fingerprint": row.fingerprint},
    )
    await _sync_owner_allocations(session, principal.subject)


SYNCABLE = (
    AllocationStatus.provisioning,
    AllocationStatus.active,
    AllocationStatus.restarting,
    AllocationStatus.resizing,
)


async def _sync_owner_allocations(session: AsyncSession, user_id: uuid.UUID) -> None:
    rows = await session.execute(
        select(allocations).where(allocations.c.owner_user_id == user_id, allocations.c.status.in_(SYNCABLE))
    )
    for row in rows.all():
        await sync_keys(session, row)


async def sync_keys(session: AsyncSession, alloc: Any) -> None:
    if alloc.status not in SYNCABLE or alloc.host_id is None:
        return
    await enqueue_task(
        session,
        alloc.host_id,
        alloc.allocation_id,
        SyncSshKeysTask(
            allocation_id=alloc.allocation_id,
            username=alloc.ssh_username,
            authorized_keys=await authorized_keys(session, alloc),
        ),
    )


def grant_state(row: Any) -> SshGrantState:
    return SshGrantState.model_validate(dict(row._mapping))


async def _is_project_member(
    session: AsyncSession, user_id: uuid.UUID, tenant_id: uuid.UUID, project_id: uuid.UUID
) -> bool:
    return await _is_member(session, user_id, tenant_id, project_id, platform_counts=False)


async def _is_member(
    session: AsyncSession, user_id: uuid.UUID, tenant_id: uuid.UUID, project_id: uuid.UUID, *, platform_counts: bool
) -> bool:
    """An unrevoked membership of the project or its tenant (or of the platform, where `platform_counts`)."""
    scopes = [
        and_(iam_memberships.c.scope == MembershipScope.project, iam_memberships.c.project_id == project_id),
        and_(iam_memberships.c.scope == MembershipScope.tenant, iam_memberships.c.tenant_id == tenant_id),
    ]
    if platform_counts:
        scopes.append(iam_memberships.c.scope == MembershipScope.platform)
    q = select(iam_memberships.c.membership_id).where(
        iam_memberships.c.user_id == user_id, iam_memberships.c.revoked.is_(False), or_(*scopes)
    )
    return (await session.execute(q.limit(1))).first() is not None


async def create_grant(
    session: AsyncSession,
    principal: Principal,
    alloc_id: uuid.UUID,
    *,
    user_id: uuid.UUID,
    public_key: str,
    expected_version: int | None = None,
) -> AllocationChange[SshGrantState]:
    """The allocation's owner or a project admin gives another project member SSH access with the
    member's own public key. `expected_version` is the allocation's (grants do not change it)."""
    alloc = await load_allocation(session, principal, alloc_id, "allocations.read", lock=True)
    if alloc.owner_user_id != principal.subject:
        await iam.authorize(session, principal, "allocations.ssh_grant.manage", project_id=alloc.project_id)
    check_version(alloc.version, expected_version)
    if alloc.status not in SYNCABLE:
        raise Conflict(f"the allocation is {alloc.status}", code="allocation_not_active")
    if not await _is_project_member(session, user_id, alloc.tenant_id, alloc.project_id):
        raise Unprocessable("the grantee is not a member of the allocation's project", code="grantee_not_member")
    line, fp = domain.parse_public_key(public_key)
    dup = (
        await session.execute(
            select(ssh_grants.c.grant_id).where(
                ssh_grants.c.allocation_id == alloc_id, ssh_grants.c.fingerprint == fp, ssh_grants.c.status == "active"
            )
        )
    ).first()
    if dup:
        raise Conflict("this key already has an active grant on the allocation", code="ssh_grant_exists")
    grant_id = new_event_id()
    row = (
        await session.execute(
            insert(ssh_grants)
            .values(
                grant_id=grant_id,
                allocation_id=alloc_id,
                tenant_id=alloc.tenant_id,
                project_id=alloc.project_id,
                origin="user",
                user_id=user_id,
                public_key=line,
                fingerprint=fp,
                status="active",
                granted_by=str(principal.subject),
                created_at=now(),
                version=1,
            )
            .returning(*ssh_grants.c)
        )
    ).one()
    state = grant_state(row)
    await add_event(session, allocation_events.SshGrantCreated.build(data=state, source=SERVICE, actor=principal.actor))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.ssh_grant.create",
        resource_type="ssh_grant",
        resource_id=grant_id,
        tenant_id=alloc.tenant_id,
        project_id=alloc.project_id,
        after={"allocation_id": str(alloc_id), "user_id": str(user_id), "fingerprint": fp},
    )
    await record_timeline(session, alloc_id, "access", "info", f"SSH access granted to user {user_id} ({fp})")
    await sync_keys(session, alloc)
    return AllocationChange(body=state, version=alloc.version, host_id=alloc.host_id)


async def list_grants(session: AsyncSession, principal: Principal, alloc_id: uuid.UUID) -> list[SshGrantState]:
    await load_allocation(session, principal, alloc_id, "allocations.read")
    rows = await session.execute(
        select(ssh_grants).where(ssh_grants.c.allocation_id == alloc_id).order_by(ssh_grants.c.created_at)
    )
    return [grant_state(r) for r in rows]


async def revoke_grant(
    session: AsyncSession,
    principal: Principal,
    alloc_id: uuid.UUID,
    grant_id: uuid.UUID,
    *,
    expected_version: int | None = None,
) -> AllocationChange[SshGrantState]:
    """Revoke a user's grant (the grantee may revoke their own); `expected_version` is the allocation's."""
    alloc = await load_allocation(session, principal, alloc_id, "allocations.read", lock=True)
    grant = (
        await session.execute(
            select(ssh_grants)
            .where(ssh_grants.c.grant_id == grant_id, ssh_grants.c.allocation_id == alloc_id)
            .with_for_update()
        )
    ).first()
    if grant is None:
        raise NotFound("grant not found", code="ssh_grant_not_found")
    if alloc.owner_user_id != principal.subject and grant.user_id != principal.subject:
        await iam.authorize(session, principal, "allocations.ssh_grant.manage", project_id=alloc.project_id)
    check_version(alloc.version, expected_version)
    if grant.origin != "user":
        raise Conflict("this key belongs to an app instance; app-runtime revokes it", code="ssh_grant_managed")
    if grant.status == "revoked":
        return AllocationChange(body=grant_state(grant), version=alloc.version, host_id=alloc.host_id)
    row = await _revoke_grant_row(session, grant, principal.actor)
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.ssh_grant.revoke",
        resource_type="ssh_grant",
        resource_id=grant_id,
        tenant_id=alloc.tenant_id,
        project_id=alloc.project_id,
        before={"status": "active"},
        after={"status": "revoked"},
    )
    await sync_keys(session, alloc)
    return AllocationChange(body=grant_state(row), version=alloc.version, host_id=alloc.host_id)


async def _revoke_grant_row(session: AsyncSession, grant: Any, actor: Actor) -> Any:
    row = (
        await session.execute(
            update(ssh_grants)
            .where(ssh_grants.c.grant_id == grant.grant_id)
            .values(status="revoked", revoked_at=now(), version=ssh_grants.c.version + 1)
            .returning(*ssh_grants.c)
        )
    ).one()
    await add_event(
        session, allocation_events.SshGrantRevoked.build(data=grant_state(row), source=SERVICE, actor=actor)
    )
    await record_timeline(session, grant.allocation_id, "access", "info", f"SSH access revoked ({grant.fingerprint})")
    return row


async def apply_access_grant(session: AsyncSession, grant: Any, *, revoked: bool, actor: Actor) -> None:
    """App-runtime's controller key (AccessGrantState) becomes SSH grants on the listed allocations
    of the same project; allocations no longer listed (or a revoked grant) lose the key."""
    wanted: set[uuid.UUID] = set() if revoked or grant.status == "revoked" else set(grant.allocation_ids)
    existing = {
        r.allocation_id: r
        for r in (
            await session.execute(
                select(ssh_grants).where(ssh_grants.c.access_grant_id == grant.access_grant_id).with_for_update()
            )
        ).all()
    }
    touched: set[uuid.UUID] = set()
    for alloc_id in wanted:
        alloc = (
            await session.execute(
                select(allocations).where(
                    allocations.c.allocation_id == alloc_id, allocations.c.project_id == grant.project_id
                )
            )
        ).first()
        if alloc is None or alloc.status not in SYNCABLE:
            continue
        cur = existing.get(alloc_id)
        if cur is not None and cur.status == "active" and cur.public_key == grant.public_key:
            continue
        if cur is not None:
            row = (
                await session.execute(
                    update(ssh_grants)
                    .where(ssh_grants.c.grant_id == cur.grant_id)
                    .values(
                        status="active",
                        revoked_at=None,
                        public_key=grant.public_key,
                        fingerprint=grant.fingerprint,
                        version=ssh_grants.c.version + 1,
                    )
                    .returning(*ssh_grants.c)
                )
            ).one()
        else:
            row = (
                await session.execute(
                    insert(ssh_grants)
                    .values(
                        grant_id=new_event_id(),
                        allocation_id=alloc_id,
                        tenant_id=alloc.tenant_id,
                        project_id=alloc.project_id,
                        origin="app_access_grant",
                        access_grant_id=grant.access_grant_id,
                        public_key=grant.public_key,
                        fingerprint=grant.fingerprint,
                        status="active",
                        granted_by=f"app-instance:{grant.instance_id}",
                        created_at=now(),
                        version=1,
                    )
                    .returning(*ssh_grants.c)
                )
            ).one()
        await add_event(
            session, allocation_events.SshGrantCreated.build(data=grant_state(row), source=SERVICE, actor=actor)
        )
        await audit.record(
            session,
            service=SERVICE,
            actor=actor,
            action="allocations.ssh_grant.create",
            resource_type="ssh_grant",
            resource_id=row.grant_id,
            tenant_id=alloc.tenant_id,
            project_id=alloc.project_id,
            reason=f"app access grant {grant.access_grant_id}",
            after={"allocation_id": str(alloc_id), "fingerprint": grant.fingerprint},
        )
        touched.add(alloc_id)
    for alloc_id, cur in existing.items():
        if alloc_id not in wanted and cur.status == "active":
            row = await _revoke_grant_row(session, cur, actor)
            await audit.record(
                session,
                service=SERVICE,
                actor=actor,
                action="allocations.ssh_grant.revoke",
                resource_type="ssh_grant",
                resource_id=row.grant_id,
                tenant_id=row.tenant_id,
                project_id=row.project_id,
                reason=f"app access grant {grant.access_grant_id}",
            )
            touched.add(alloc_id)
    for alloc_id in touched:
        alloc = (await session.execute(select(allocations).where(allocations.c.allocation_id == alloc_id))).one()
        await sync_keys(session, alloc)


TERMINAL_CA = "terminal-ssh-ca"
PLATFORM_KEY_CONTEXT = "allocations.platform_keys.private_key"


async def terminal_ca_private_key(session: AsyncSession, new_private_key: str, new_public_key: str) -> str:
    """The platform's terminal CA (one key shared by every replica): the first replica's key wins. The private
    key is sealed at rest under the operator's keyring; a clear key of an older version is sealed first."""
    keyring = keyring_of(session)
    await reseal_column(session, platform_keys, "name", "private_key", PLATFORM_KEY_CONTEXT)
    sealed = keyring.seal(new_private_key, f"{PLATFORM_KEY_CONTEXT}:{TERMINAL_CA}")
    await session.execute(
        pg_insert(platform_keys)
        .values(name=TERMINAL_CA, private_key=sealed, public_key=new_public_key)
        .on_conflict_do_nothing()
    )
    row = (await session.execute(select(platform_keys.c.private_key).where(platform_keys.c.name == TERMINAL_CA))).one()
    return keyring.open(row.private_key, f"{PLATFORM_KEY_CONTEXT}:{TERMINAL_CA}")


async def open_terminal(session: AsyncSession, principal: Principal, alloc_id: uuid.UUID) -> TerminalTarget:
    """Who may open the browser terminal of an active allocation, and where its SSH endpoint is (audited)."""
    alloc = await load_allocation(session, principal, alloc_id, "allocations.read")
    await _terminal_allowed(session, principal, alloc)
    if alloc.status != AllocationStatus.active or not alloc.ssh_host:
        raise Problem(f"the allocation is {alloc.status}", status=409, code="allocation_not_active")
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="allocations.terminal.open",
        resource_type="allocation",
        resource_id=alloc_id,
        tenant_id=alloc.tenant_id,
        project_id=alloc.project_id,
    )
    # The endpoint and the host key the terminal must see are the host's pinned ones (see agents.py).
    host = (
        await session.execute(
            select(hosts.c.ssh_host, hosts.c.ssh_port, hosts.c.ssh_host_key).where(hosts.c.host_id == alloc.host_id)
        )
    ).one()
    return TerminalTarget(
        host=host.ssh_host or alloc.ssh_host,
        port=host.ssh_port or alloc.ssh_port,
        username=alloc.ssh_username,
        host_key=host.ssh_host_key,
    )


async def ssh_host_key(session: AsyncSession, principal: Principal, alloc_id: uuid.UUID) -> SshHostKey:
    """The SSH endpoint of a placed allocation and the host key pinned for it (a public key: its readers may
    see it), so the CLI and the SDK verify the host instead of trusting the first key they meet."""
    alloc = await load_allocation(session, principal, alloc_id, "allocations.read")
    q = select(hosts.c.ssh_host, hosts.c.ssh_port, hosts.c.ssh_host_key, hosts.c.ssh_host_key_fingerprint)
    host = None if alloc.host_id is None else (await session.execute(q.where(hosts.c.host_id == alloc.host_id))).first()
    if host is None or not (host.ssh_host or alloc.ssh_host):
        raise Problem(f"the allocation is {alloc.status}: no SSH endpoint yet", status=409, code="no_ssh_endpoint")
    if not host.ssh_host_key:
        pending = "the host's SSH key is not pinned yet (its agent has not registered one)"
        raise Problem(pending, status=409, code="host_key_not_pinned")
    name, port = host.ssh_host or alloc.ssh_host, host.ssh_port or alloc.ssh_port
    key = " ".join(host.ssh_host_key.split()[:2])
    return SshHostKey(
        host=name,
        port=port,
        username=alloc.ssh_username,
        host_key=key,
        fingerprint=host.ssh_host_key_fingerprint,
        known_hosts=f"{name if port == 22 else f'[{name}]:{port}'} {key}",
    )


async def terminal_still_allowed(session: AsyncSession, principal: Principal, alloc_id: uuid.UUID) -> uuid.UUID:
    """The open terminal's re-check (on every revocation event and at token expiry): may the viewer still
    read the allocation and hold SSH access to it? Returns its project (what the stream watches)."""
    alloc = await load_allocation(session, principal, alloc_id, "allocations.read")
    await _terminal_allowed(session, principal, alloc)
    return uuid.UUID(str(alloc.project_id))


async def _terminal_allowed(session: AsyncSession, principal: Principal, alloc: Any) -> None:
    """The terminal is SSH access: the owner, an active grantee, or a project admin."""
    if alloc.owner_user_id == principal.subject:
        return
    grantee = (
        await session.execute(
            select(ssh_grants.c.grant_id).where(
                ssh_grants.c.allocation_id == alloc.allocation_id,
                ssh_grants.c.user_id == principal.subject,
                ssh_grants.c.status == "active",
            )
        )
    ).first()
    if grantee:
        return
    await iam.authorize(session, principal, "allocations.ssh_grant.manage", project_id=alloc.project_id)
