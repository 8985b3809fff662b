"""Users and memberships: accounts (tenant, platform, the bootstrap operator), granting and revoking
roles, disabling accounts, and the reads of them (`/me`, a tenant's users, a project's members).

Each use case runs in the caller's transaction: state + outbox events + audit record commit together.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Literal

from sqlalchemy import Row, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Actor, new_event_id
from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.events import identity as identity_events
from gpuaas.identity.domain import PROJECT_ROLES, TENANT_ROLES
from gpuaas.identity.models import memberships, projects, tenants, users
from gpuaas.identity.passwords import hash_password
from gpuaas.identity.service import views
from gpuaas.identity.service.common import actor_of, record_change
from gpuaas.identity.service.sessions import revoke_user_sessions
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, Forbidden, NotFound, Unprocessable

AccountStatus = Literal["active", "disabled"]
# Serializes the first operator's creation across replicas starting together.
BOOTSTRAP_LOCK = 7001


async def bootstrap_admin(session: AsyncSession, email: str, password: str) -> uuid.UUID | None:
    """Create the first platform operator if no user has this email (idempotent across restarts)."""
    await session.execute(select(func.pg_advisory_xact_lock(BOOTSTRAP_LOCK)))
    existing = (
        await session.execute(select(users.c.user_id).where(func.lower(users.c.email) == email.lower()))
    ).first()
    if existing:
        return None
    user_id = await insert_user(
        session, None, email=email, password=password, display_name="Platform admin", tenant_id=None
    )
    await grant(session, None, user_id=user_id, scope=MembershipScope.platform, role=Role.platform_admin)
    return user_id


async def insert_user(
    session: AsyncSession,
    principal: Principal | None,
    *,
    email: str,
    password: str | None,
    display_name: str,
    tenant_id: uuid.UUID | None,
    email_verified: bool = False,
    actor: Actor | None = None,
) -> uuid.UUID:
    who = actor or actor_of(principal)
    user_id = new_event_id()
    taken = (await session.execute(select(users.c.user_id).where(func.lower(users.c.email) == email.lower()))).first()
    if taken:
        raise Conflict("a user with this email already exists", code="email_taken")
    await session.execute(
        insert(users).values(
            user_id=user_id,
            email=email,
            display_name=display_name,
            tenant_id=tenant_id,
            password_hash=await asyncio.to_thread(hash_password, password) if password else None,
            status="active",
            email_verified=email_verified,
        )
    )
    state = identity_events.UserState(user_id=user_id, email=email, display_name=display_name, tenant_id=tenant_id)
    await record_change(
        session,
        identity_events.UserCreated,
        state,
        actor=who,
        action="identity.user.create",
        resource_type="user",
        resource_id=user_id,
        tenant_id=tenant_id,
        after={"email": email, "display_name": display_name},
    )
    return user_id


async def grant(
    session: AsyncSession,
    principal: Principal | None,
    *,
    user_id: uuid.UUID,
    scope: MembershipScope,
    role: Role,
    tenant_id: uuid.UUID | None = None,
    project_id: uuid.UUID | None = None,
    actor: Actor | None = None,
) -> uuid.UUID:
    who = actor or actor_of(principal)
    membership_id = new_event_id()
    await session.execute(
        insert(memberships).values(
            membership_id=membership_id,
            user_id=user_id,
            scope=scope,
            role=role,
            tenant_id=tenant_id,
            project_id=project_id,
        )
    )
    state = identity_events.MembershipState(
        membership_id=membership_id, user_id=user_id, scope=scope, role=role, tenant_id=tenant_id, project_id=project_id
    )
    await record_change(
        session,
        identity_events.MembershipGranted,
        state,
        actor=who,
        action="identity.membership.grant",
        resource_type="membership",
        resource_id=membership_id,
        tenant_id=tenant_id,
        project_id=project_id,
    )
    return membership_id


async def create_tenant_user(
    session: AsyncSession,
    principal: Principal,
    *,
    tenant_id: uuid.UUID,
    email: str,
    password: str,
    display_name: str,
    role: Role | None,
    project_id: uuid.UUID | None = None,
    email_verified: bool = False,
) -> views.UserCreated:
    """A user of the tenant, with a tenant-wide role, or a project role in `project_id`. A project_admin
    always names its project: at tenant scope it would administer every project under a project role."""
    await iam.authorize(session, principal, "identity.member.manage", tenant_id=tenant_id)
    if not (await session.execute(select(tenants.c.tenant_id).where(tenants.c.tenant_id == tenant_id))).first():
        raise NotFound("tenant not found", code="tenant_not_found")
    if project_id is not None:
        if role not in PROJECT_ROLES:
            raise Unprocessable(f"{role} cannot be granted at project scope", code="invalid_role")
        owner = (
            await session.execute(
                select(projects.c.tenant_id).where(projects.c.project_id == project_id, projects.c.archived.is_(False))
            )
        ).scalar()
        if owner != tenant_id:
            raise NotFound("no such project in this tenant", code="project_not_found")
    elif role is Role.project_admin:
        raise Unprocessable(
            "project_admin is granted in a project: give project_id (or add the user to a project later)",
            code="project_required",
        )
    elif role is not None and role not in TENANT_ROLES:
        raise Unprocessable(f"{role} cannot be granted at tenant scope", code="invalid_role")
    # A verified email is what brokered linking trusts: only an operator may vouch for one by hand
    # (otherwise it becomes verified through an IdP that proved it owns the email's domain).
    if email_verified and not await iam.is_platform_admin(session, principal):
        raise Forbidden("only a platform admin can mark an email verified", code="email_verification_forbidden")
    user_id = await insert_user(
        session,
        principal,
        email=email,
        password=password,
        display_name=display_name,
        tenant_id=tenant_id,
        email_verified=email_verified,
    )
    membership_id = None
    if role is not None:
        scope = MembershipScope.project if project_id is not None else MembershipScope.tenant
        membership_id = await grant(
            session, principal, user_id=user_id, scope=scope, role=role, tenant_id=tenant_id, project_id=project_id
        )
    return views.UserCreated(user_id=user_id, email=email, tenant_id=tenant_id, membership_id=membership_id)


async def create_platform_user(
    session: AsyncSession, principal: Principal, *, email: str, password: str, display_name: str
) -> views.UserCreated:
    """A platform account without a tenant (an operator-to-be, or a personal account)."""
    await iam.authorize(session, principal, "identity.platform_admin.manage")
    user_id = await insert_user(
        session, principal, email=email, password=password, display_name=display_name, tenant_id=None
    )
    return views.UserCreated(user_id=user_id, email=email, tenant_id=None, membership_id=None)


async def _require_tenant_user(session: AsyncSession, user_id: uuid.UUID, tenant_id: uuid.UUID | None) -> None:
    """Roles in a tenant (or its projects) go to that tenant's own users only."""
    user = (await session.execute(select(users.c.tenant_id).where(users.c.user_id == user_id))).first()
    if user is None or user.tenant_id != tenant_id:
        raise NotFound("no such user in this tenant", code="user_not_found")


async def add_tenant_member(
    session: AsyncSession, principal: Principal, *, tenant_id: uuid.UUID, user_id: uuid.UUID, role: Role
) -> views.Granted:
    await iam.authorize(session, principal, "identity.member.manage", tenant_id=tenant_id)
    if role not in TENANT_ROLES:
        raise Unprocessable(f"{role} cannot be granted at tenant scope", code="invalid_role")
    await _require_tenant_user(session, user_id, tenant_id)
    membership_id = await grant(
        session, principal, user_id=user_id, scope=MembershipScope.tenant, role=role, tenant_id=tenant_id
    )
    return views.Granted(membership_id=membership_id, user_id=user_id, tenant_id=tenant_id, role=role)


async def add_project_member(
    session: AsyncSession, principal: Principal, *, project_id: uuid.UUID, user_id: uuid.UUID, role: Role
) -> views.Granted:
    await iam.authorize(session, principal, "identity.member.manage", project_id=project_id)
    if role not in PROJECT_ROLES:
        raise Unprocessable(f"{role} cannot be granted at project scope", code="invalid_role")
    tenant_id = (
        await session.execute(select(projects.c.tenant_id).where(projects.c.project_id == project_id))
    ).scalar()
    await _require_tenant_user(session, user_id, tenant_id)
    membership_id = await grant(
        session,
        principal,
        user_id=user_id,
        scope=MembershipScope.project,
        role=role,
        tenant_id=tenant_id,
        project_id=project_id,
    )
    # The answer names the project only (its tenant_id stays null), as it always has.
    return views.Granted(membership_id=membership_id, user_id=user_id, project_id=project_id, role=role)


async def grant_platform_admin(session: AsyncSession, principal: Principal, *, user_id: uuid.UUID) -> views.Granted:
    await iam.authorize(session, principal, "identity.platform_admin.manage")
    user = (await session.execute(select(users.c.tenant_id).where(users.c.user_id == user_id))).first()
    if user is None:
        raise NotFound("user not found", code="user_not_found")
    if user.tenant_id is not None:
        raise Unprocessable("operators are platform accounts, not members of a tenant", code="invalid_role")
    membership_id = await grant(
        session, principal, user_id=user_id, scope=MembershipScope.platform, role=Role.platform_admin
    )
    return views.Granted(membership_id=membership_id, user_id=user_id, role=Role.platform_admin)


async def revoke_membership(session: AsyncSession, principal: Principal, membership_id: uuid.UUID) -> None:
    row = (
        await session.execute(select(memberships).where(memberships.c.membership_id == membership_id).with_for_update())
    ).first()
    if row is None:
        raise NotFound("membership not found", code="membership_not_found")
    await iam.authorize(
        session, principal, "identity.member.manage", tenant_id=row.tenant_id, project_id=row.project_id
    )
    if row.revoked:
        return
    await session.execute(
        update(memberships)
        .where(memberships.c.membership_id == membership_id)
        .values(revoked=True, revoked_at=func.now())
    )
    state = identity_events.MembershipState(
        membership_id=membership_id,
        user_id=row.user_id,
        scope=row.scope,
        role=row.role,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        revoked=True,
    )
    await record_change(
        session,
        identity_events.MembershipRevoked,
        state,
        actor=principal.actor,
        action="identity.membership.revoke",
        resource_type="membership",
        resource_id=membership_id,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        before={"revoked": False},
        after={"revoked": True},
    )


async def set_user_status(
    session: AsyncSession, principal: Principal, user_id: uuid.UUID, status: AccountStatus
) -> views.UserStatus:
    """Disable or enable an account; disabling revokes its sessions (every service denies it once the
    event lands)."""
    row = (await session.execute(select(users).where(users.c.user_id == user_id).with_for_update())).first()
    if row is None:
        raise NotFound("user not found", code="user_not_found")
    await iam.authorize(session, principal, "identity.user.manage", tenant_id=row.tenant_id)
    if row.user_id == principal.subject:
        raise Unprocessable("you cannot change your own account status", code="self_status_change")
    if row.status != status:
        await session.execute(update(users).where(users.c.user_id == user_id).values(status=status))
        state = identity_events.UserState(
            user_id=user_id,
            email=row.email,
            display_name=row.display_name,
            tenant_id=row.tenant_id,
            status=status,
        )
        await record_change(
            session,
            identity_events.UserUpdated,
            state,
            actor=principal.actor,
            action="identity.user.status",
            resource_type="user",
            resource_id=user_id,
            tenant_id=row.tenant_id,
            before={"status": row.status},
            after={"status": status},
        )
        if status == "disabled":
            await revoke_user_sessions(session, user_id, reason="account_disabled", actor=principal)
    return views.UserStatus(user_id=user_id, email=row.email, tenant_id=row.tenant_id, status=status)


# --------------------------------------------------------------------------------------- reads


def _membership(r: Row, email: str | None = None, display_name: str | None = None) -> views.Membership:
    return views.Membership(
        membership_id=r.membership_id,
        user_id=r.user_id,
        scope=r.scope,
        role=r.role,
        tenant_id=r.tenant_id,
        project_id=r.project_id,
        email=email,
        display_name=display_name,
    )


async def me(session: AsyncSession, principal: Principal) -> views.Me:
    user = (await session.execute(select(users).where(users.c.user_id == principal.subject))).first()
    if user is None:
        raise NotFound("user not found", code="user_not_found")
    rows = await session.execute(
        select(memberships).where(memberships.c.user_id == principal.subject, memberships.c.revoked.is_(False))
    )
    return views.Me(
        user_id=user.user_id,
        email=user.email,
        display_name=user.display_name,
        tenant_id=user.tenant_id,
        status=user.status,
        email_verified=user.email_verified,
        memberships=[_membership(r) for r in rows],
    )


async def list_tenant_users(session: AsyncSession, principal: Principal, tenant_id: uuid.UUID) -> list[views.User]:
    await iam.authorize(session, principal, "identity.user.read", tenant_id=tenant_id)
    rows = await session.execute(select(users).where(users.c.tenant_id == tenant_id).order_by(users.c.email))
    return [
        views.User(
            user_id=r.user_id,
            email=r.email,
            display_name=r.display_name,
            tenant_id=r.tenant_id,
            status=r.status,
            email_verified=r.email_verified,
            last_login_at=r.last_login_at,
        )
        for r in rows
    ]


async def list_project_members(
    session: AsyncSession, principal: Principal, project_id: uuid.UUID
) -> list[views.Membership]:
    await iam.authorize(session, principal, "identity.member.read", project_id=project_id)
    rows = await session.execute(
        select(memberships, users.c.email, users.c.display_name)
        .join(users, users.c.user_id == memberships.c.user_id)
        .where(memberships.c.project_id == project_id, memberships.c.revoked.is_(False))
        .order_by(memberships.c.created_at)
    )
    return [_membership(r, email=r.email, display_name=r.display_name) for r in rows]
