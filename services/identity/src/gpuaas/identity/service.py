"""Identity use cases. Each is one transaction: state + outbox events + audit record commit together.

Identity applies its own events to its local IAM projection in the same transaction, so its own
authorization decisions never lag behind its writes.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Actor, Event, new_event_id
from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.events import identity as ev
from gpuaas.identity import keys
from gpuaas.identity.models import memberships, projects, tenants, users
from gpuaas.identity.passwords import hash_password, verify_password
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound, Problem, Unauthorized, Unprocessable
from gpuaas.kit.outbox import add_event

SERVICE = "identity"
PROJECT_ROLES = {Role.project_admin, Role.project_member, Role.viewer}
TENANT_ROLES = {Role.tenant_admin, *PROJECT_ROLES}


async def _emit(session: AsyncSession, event: Event) -> None:
    await add_event(session, event)
    await iam.apply_locally(session, event)


def _actor(principal: Principal | None) -> Actor:
    return principal.actor if principal else Actor.system("identity-bootstrap")


async def bootstrap_admin(session: AsyncSession, email: str, password: str) -> uuid.UUID | None:
    """Create the first platform operator if no user has this email (idempotent across restarts)."""
    await session.execute(select(func.pg_advisory_xact_lock(7001)))
    existing = (
        await session.execute(select(users.c.user_id).where(func.lower(users.c.email) == email.lower()))
    ).first()
    if existing:
        return None
    user_id = await _insert_user(
        session, None, email=email, password=password, display_name="Platform admin", tenant_id=None
    )
    await _grant(session, None, user_id=user_id, scope=MembershipScope.platform, role=Role.platform_admin)
    return user_id


async def _insert_user(
    session: AsyncSession,
    principal: Principal | None,
    *,
    email: str,
    password: str | None,
    display_name: str,
    tenant_id: uuid.UUID | None,
) -> uuid.UUID:
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
            password_hash=hash_password(password) if password else None,
            status="active",
        )
    )
    state = ev.UserState(user_id=user_id, email=email, display_name=display_name, tenant_id=tenant_id)
    await _emit(
        session,
        ev.UserCreated.build(subject=user_id, data=state, source=SERVICE, tenant_id=tenant_id, actor=_actor(principal)),
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=_actor(principal),
        action="identity.user.create",
        resource_type="user",
        resource_id=user_id,
        tenant_id=tenant_id,
        after={"email": email, "display_name": display_name},
    )
    return user_id


async def _grant(
    session: AsyncSession,
    principal: Principal | None,
    *,
    user_id: uuid.UUID,
    scope: MembershipScope,
    role: Role,
    tenant_id: uuid.UUID | None = None,
    project_id: uuid.UUID | None = None,
) -> uuid.UUID:
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
    state = ev.MembershipState(
        membership_id=membership_id, user_id=user_id, scope=scope, role=role, tenant_id=tenant_id, project_id=project_id
    )
    await _emit(
        session,
        ev.MembershipGranted.build(
            subject=membership_id,
            data=state,
            source=SERVICE,
            tenant_id=tenant_id,
            project_id=project_id,
            actor=_actor(principal),
        ),
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=_actor(principal),
        action="identity.membership.grant",
        resource_type="membership",
        resource_id=membership_id,
        tenant_id=tenant_id,
        project_id=project_id,
        after=state.model_dump(mode="json"),
    )
    return membership_id


async def login(session: AsyncSession, *, email: str, password: str, issuer: str, ttl_s: int) -> dict[str, Any]:
    row = (
        await session.execute(
            select(users.c.user_id, users.c.password_hash, users.c.status, users.c.tenant_id, users.c.email).where(
                func.lower(users.c.email) == email.lower()
            )
        )
    ).first()
    if not verify_password(row.password_hash if row else None, password) or row is None:
        raise Unauthorized("the email or password is wrong", code="invalid_credentials")
    if row.status != "active":
        raise Problem("this account is disabled", code="account_disabled", status=403, title="Account disabled")
    claims = keys.access_claims(
        issuer=issuer, subject=row.user_id, kind="user", ttl_s=ttl_s, tenant_id=row.tenant_id, email=row.email
    )
    return {"access_token": await keys.sign(session, claims), "token_type": "Bearer", "expires_in": ttl_s}


async def create_tenant(session: AsyncSession, principal: Principal, *, slug: str, name: str) -> dict[str, Any]:
    await iam.authorize(session, principal, "identity.tenant.create")
    if (await session.execute(select(tenants.c.tenant_id).where(tenants.c.slug == slug))).first():
        raise Conflict(f"the tenant slug {slug!r} is taken", code="tenant_slug_taken")
    tenant_id = new_event_id()
    await session.execute(insert(tenants).values(tenant_id=tenant_id, slug=slug, name=name, status="active"))
    state = ev.TenantState(tenant_id=tenant_id, slug=slug, name=name)
    await _emit(
        session,
        ev.TenantCreated.build(
            subject=tenant_id, data=state, source=SERVICE, tenant_id=tenant_id, actor=principal.actor
        ),
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="identity.tenant.create",
        resource_type="tenant",
        resource_id=tenant_id,
        tenant_id=tenant_id,
        after=state.model_dump(mode="json"),
    )
    return state.model_dump()


async def create_project(
    session: AsyncSession, principal: Principal, *, tenant_id: uuid.UUID, name: str
) -> dict[str, Any]:
    await iam.authorize(session, principal, "identity.project.create", tenant_id=tenant_id)
    taken = await session.execute(
        select(projects.c.project_id).where(projects.c.tenant_id == tenant_id, projects.c.name == name)
    )
    if taken.first():
        raise Conflict(f"a project named {name!r} exists in this tenant", code="project_name_taken")
    project_id = new_event_id()
    await session.execute(insert(projects).values(project_id=project_id, tenant_id=tenant_id, name=name))
    state = ev.ProjectState(project_id=project_id, tenant_id=tenant_id, name=name)
    await _emit(
        session,
        ev.ProjectCreated.build(
            subject=project_id,
            data=state,
            source=SERVICE,
            tenant_id=tenant_id,
            project_id=project_id,
            actor=principal.actor,
        ),
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="identity.project.create",
        resource_type="project",
        resource_id=project_id,
        tenant_id=tenant_id,
        project_id=project_id,
        after=state.model_dump(mode="json"),
    )
    return state.model_dump()


async def create_tenant_user(
    session: AsyncSession,
    principal: Principal,
    *,
    tenant_id: uuid.UUID,
    email: str,
    password: str,
    display_name: str,
    role: Role | None,
) -> dict[str, Any]:
    await iam.authorize(session, principal, "identity.member.manage", tenant_id=tenant_id)
    if not (await session.execute(select(tenants.c.tenant_id).where(tenants.c.tenant_id == tenant_id))).first():
        raise NotFound("tenant not found", code="tenant_not_found")
    if role is not None and role not in TENANT_ROLES:
        raise Unprocessable(f"{role} cannot be granted at tenant scope", code="invalid_role")
    user_id = await _insert_user(
        session, principal, email=email, password=password, display_name=display_name, tenant_id=tenant_id
    )
    membership_id = None
    if role is not None:
        membership_id = await _grant(
            session, principal, user_id=user_id, scope=MembershipScope.tenant, role=role, tenant_id=tenant_id
        )
    return {"user_id": user_id, "email": email, "tenant_id": tenant_id, "membership_id": membership_id}


async def add_project_member(
    session: AsyncSession, principal: Principal, *, project_id: uuid.UUID, user_id: uuid.UUID, role: Role
) -> dict[str, Any]:
    await iam.authorize(session, principal, "identity.member.manage", project_id=project_id)
    if role not in PROJECT_ROLES:
        raise Unprocessable(f"{role} cannot be granted at project scope", code="invalid_role")
    tenant_id = (
        await session.execute(select(projects.c.tenant_id).where(projects.c.project_id == project_id))
    ).scalar()
    user = (await session.execute(select(users.c.tenant_id).where(users.c.user_id == user_id))).first()
    if user is None or user.tenant_id != tenant_id:
        raise NotFound("no such user in this tenant", code="user_not_found")
    membership_id = await _grant(
        session,
        principal,
        user_id=user_id,
        scope=MembershipScope.project,
        role=role,
        tenant_id=tenant_id,
        project_id=project_id,
    )
    return {"membership_id": membership_id, "user_id": user_id, "project_id": project_id, "role": role}


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
    state = ev.MembershipState(
        membership_id=membership_id,
        user_id=row.user_id,
        scope=row.scope,
        role=row.role,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        revoked=True,
    )
    await _emit(
        session,
        ev.MembershipRevoked.build(
            subject=membership_id,
            data=state,
            source=SERVICE,
            tenant_id=row.tenant_id,
            project_id=row.project_id,
            actor=principal.actor,
        ),
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="identity.membership.revoke",
        resource_type="membership",
        resource_id=membership_id,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        before={"revoked": False},
        after={"revoked": True},
    )
