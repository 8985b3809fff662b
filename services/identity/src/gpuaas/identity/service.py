"""Identity use cases. Each is one transaction: state + outbox events + audit record commit together.

Identity applies its own events to its local IAM projection in the same transaction, so its own
authorization decisions never lag behind its writes.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import Actor, Event, new_event_id
from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.events import identity as ev
from gpuaas.identity import keys
from gpuaas.identity.models import memberships, projects, service_accounts, signing_keys, tenants, users
from gpuaas.identity.passwords import hash_password
from gpuaas.identity.tokens import new_secret, revoke_user_sessions, token_hash
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Conflict, NotFound, Unprocessable
from gpuaas.kit.outbox import add_event

SERVICE = "identity"
PROJECT_ROLES = {Role.project_admin, Role.project_member, Role.viewer}
TENANT_ROLES = {Role.tenant_admin, *PROJECT_ROLES}


async def emit(session: AsyncSession, event: Event) -> None:
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
    who = actor or _actor(principal)
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
    state = ev.UserState(user_id=user_id, email=email, display_name=display_name, tenant_id=tenant_id)
    await emit(
        session,
        ev.UserCreated.build(subject=user_id, data=state, source=SERVICE, tenant_id=tenant_id, actor=who),
    )
    await audit.record(
        session,
        service=SERVICE,
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
    who = actor or _actor(principal)
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
    await emit(
        session,
        ev.MembershipGranted.build(
            subject=membership_id,
            data=state,
            source=SERVICE,
            tenant_id=tenant_id,
            project_id=project_id,
            actor=who,
        ),
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=who,
        action="identity.membership.grant",
        resource_type="membership",
        resource_id=membership_id,
        tenant_id=tenant_id,
        project_id=project_id,
        after=state.model_dump(mode="json"),
    )
    return membership_id


async def create_tenant(session: AsyncSession, principal: Principal, *, slug: str, name: str) -> dict[str, Any]:
    await iam.authorize(session, principal, "identity.tenant.create")
    if (await session.execute(select(tenants.c.tenant_id).where(tenants.c.slug == slug))).first():
        raise Conflict(f"the tenant slug {slug!r} is taken", code="tenant_slug_taken")
    tenant_id = new_event_id()
    await session.execute(insert(tenants).values(tenant_id=tenant_id, slug=slug, name=name, status="active"))
    state = ev.TenantState(tenant_id=tenant_id, slug=slug, name=name)
    await emit(
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
    await emit(
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
    email_verified: bool = False,
) -> dict[str, Any]:
    await iam.authorize(session, principal, "identity.member.manage", tenant_id=tenant_id)
    if not (await session.execute(select(tenants.c.tenant_id).where(tenants.c.tenant_id == tenant_id))).first():
        raise NotFound("tenant not found", code="tenant_not_found")
    if role is not None and role not in TENANT_ROLES:
        raise Unprocessable(f"{role} cannot be granted at tenant scope", code="invalid_role")
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
        membership_id = await grant(
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
    membership_id = await grant(
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
    await emit(
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


# --------------------------------------------------------------------------------------- reads


async def me(session: AsyncSession, principal: Principal) -> dict[str, Any]:
    user = (await session.execute(select(users).where(users.c.user_id == principal.subject))).first()
    if user is None:
        raise NotFound("user not found", code="user_not_found")
    rows = await session.execute(
        select(memberships).where(memberships.c.user_id == principal.subject, memberships.c.revoked.is_(False))
    )
    return {
        "user_id": user.user_id,
        "email": user.email,
        "display_name": user.display_name,
        "tenant_id": user.tenant_id,
        "status": user.status,
        "email_verified": user.email_verified,
        "memberships": [_membership(r) for r in rows],
    }


def _membership(r: Any) -> dict[str, Any]:
    return {
        "membership_id": r.membership_id,
        "user_id": r.user_id,
        "scope": r.scope,
        "role": r.role,
        "tenant_id": r.tenant_id,
        "project_id": r.project_id,
    }


def _tenant(r: Any) -> dict[str, Any]:
    return {"tenant_id": r.tenant_id, "slug": r.slug, "name": r.name, "status": r.status}


def _project(r: Any) -> dict[str, Any]:
    return {"project_id": r.project_id, "tenant_id": r.tenant_id, "name": r.name, "archived": r.archived}


async def list_tenants(session: AsyncSession, principal: Principal) -> list[dict[str, Any]]:
    query = select(tenants).order_by(tenants.c.slug)
    if not await iam.is_platform_admin(session, principal):
        mine = select(memberships.c.tenant_id).where(
            memberships.c.user_id == principal.subject, memberships.c.revoked.is_(False)
        )
        query = query.where(tenants.c.tenant_id.in_(mine))
    return [_tenant(r) for r in await session.execute(query)]


async def get_tenant(session: AsyncSession, principal: Principal, tenant_id: uuid.UUID) -> dict[str, Any]:
    await iam.authorize(session, principal, "identity.tenant.read", tenant_id=tenant_id)
    row = (await session.execute(select(tenants).where(tenants.c.tenant_id == tenant_id))).first()
    if row is None:
        raise NotFound("tenant not found", code="tenant_not_found")
    return _tenant(row)


async def list_projects(session: AsyncSession, principal: Principal, tenant_id: uuid.UUID) -> list[dict[str, Any]]:
    """The tenant's projects the caller can see: all for tenant admins/operators, else their own."""
    visible = await iam.visible_project_ids(session, principal)
    if visible is not None:
        member = (
            await session.execute(
                select(memberships.c.membership_id).where(
                    memberships.c.user_id == principal.subject,
                    memberships.c.tenant_id == tenant_id,
                    memberships.c.revoked.is_(False),
                )
            )
        ).first()
        if member is None and principal.tenant_id != tenant_id:
            raise NotFound("tenant not found", code="not_found")
    query = select(projects).where(projects.c.tenant_id == tenant_id).order_by(projects.c.name)
    if visible is not None:
        query = query.where(projects.c.project_id.in_(visible or [uuid.UUID(int=0)]))
    return [_project(r) for r in await session.execute(query)]


async def get_project(session: AsyncSession, principal: Principal, project_id: uuid.UUID) -> dict[str, Any]:
    await iam.authorize(session, principal, "identity.project.read", project_id=project_id)
    row = (await session.execute(select(projects).where(projects.c.project_id == project_id))).one()
    return _project(row)


async def list_project_members(session: AsyncSession, principal: Principal, project_id: uuid.UUID) -> list[dict]:
    await iam.authorize(session, principal, "identity.member.read", project_id=project_id)
    rows = await session.execute(
        select(memberships, users.c.email)
        .join(users, users.c.user_id == memberships.c.user_id)
        .where(memberships.c.project_id == project_id, memberships.c.revoked.is_(False))
        .order_by(memberships.c.created_at)
    )
    return [{**_membership(r), "email": r.email} for r in rows]


async def list_tenant_users(session: AsyncSession, principal: Principal, tenant_id: uuid.UUID) -> list[dict]:
    await iam.authorize(session, principal, "identity.user.read", tenant_id=tenant_id)
    rows = await session.execute(select(users).where(users.c.tenant_id == tenant_id).order_by(users.c.email))
    return [
        {
            "user_id": r.user_id,
            "email": r.email,
            "display_name": r.display_name,
            "tenant_id": r.tenant_id,
            "status": r.status,
            "email_verified": r.email_verified,
            "last_login_at": r.last_login_at,
        }
        for r in rows
    ]


# ----------------------------------------------------------------------------------- membership


async def add_tenant_member(
    session: AsyncSession, principal: Principal, *, tenant_id: uuid.UUID, user_id: uuid.UUID, role: Role
) -> dict[str, Any]:
    await iam.authorize(session, principal, "identity.member.manage", tenant_id=tenant_id)
    if role not in TENANT_ROLES:
        raise Unprocessable(f"{role} cannot be granted at tenant scope", code="invalid_role")
    user = (await session.execute(select(users.c.tenant_id).where(users.c.user_id == user_id))).first()
    if user is None or user.tenant_id != tenant_id:
        raise NotFound("no such user in this tenant", code="user_not_found")
    membership_id = await grant(
        session, principal, user_id=user_id, scope=MembershipScope.tenant, role=role, tenant_id=tenant_id
    )
    return {"membership_id": membership_id, "user_id": user_id, "tenant_id": tenant_id, "role": role}


async def grant_platform_admin(session: AsyncSession, principal: Principal, *, user_id: uuid.UUID) -> dict[str, Any]:
    await iam.authorize(session, principal, "identity.platform_admin.manage")
    user = (await session.execute(select(users.c.tenant_id).where(users.c.user_id == user_id))).first()
    if user is None:
        raise NotFound("user not found", code="user_not_found")
    if user.tenant_id is not None:
        raise Unprocessable("operators are platform accounts, not members of a tenant", code="invalid_role")
    membership_id = await grant(
        session, principal, user_id=user_id, scope=MembershipScope.platform, role=Role.platform_admin
    )
    return {"membership_id": membership_id, "user_id": user_id, "role": Role.platform_admin}


async def create_platform_user(
    session: AsyncSession, principal: Principal, *, email: str, password: str, display_name: str
) -> dict[str, Any]:
    """A platform account without a tenant (an operator-to-be, or a personal account)."""
    await iam.authorize(session, principal, "identity.platform_admin.manage")
    user_id = await insert_user(
        session, principal, email=email, password=password, display_name=display_name, tenant_id=None
    )
    return {"user_id": user_id, "email": email, "tenant_id": None, "membership_id": None}


async def set_user_status(session: AsyncSession, principal: Principal, user_id: uuid.UUID, status: str) -> dict:
    row = (await session.execute(select(users).where(users.c.user_id == user_id).with_for_update())).first()
    if row is None:
        raise NotFound("user not found", code="user_not_found")
    await iam.authorize(session, principal, "identity.user.manage", tenant_id=row.tenant_id)
    if row.user_id == principal.subject:
        raise Unprocessable("you cannot change your own account status", code="self_status_change")
    if row.status != status:
        await session.execute(update(users).where(users.c.user_id == user_id).values(status=status))
        state = ev.UserState(
            user_id=user_id, email=row.email, display_name=row.display_name, tenant_id=row.tenant_id, status=status
        )
        await emit(
            session,
            ev.UserUpdated.build(
                subject=user_id, data=state, source=SERVICE, tenant_id=row.tenant_id, actor=principal.actor
            ),
        )
        await audit.record(
            session,
            service=SERVICE,
            actor=principal,
            action="identity.user.status",
            resource_type="user",
            resource_id=user_id,
            tenant_id=row.tenant_id,
            before={"status": row.status},
            after={"status": status},
        )
        if status == "disabled":
            await revoke_user_sessions(session, user_id, reason="account_disabled", actor=principal)
    return {"user_id": user_id, "email": row.email, "tenant_id": row.tenant_id, "status": status}


# ------------------------------------------------------------------------------ service accounts


def _sa(r: Any) -> dict[str, Any]:
    return {
        "service_account_id": r.service_account_id,
        "client_id": str(r.service_account_id),
        "tenant_id": r.tenant_id,
        "project_id": r.project_id,
        "name": r.name,
        "scopes": list(r.scopes),
        "disabled": r.disabled,
        "created_at": r.created_at,
        "secret_rotated_at": r.secret_rotated_at,
    }


async def _emit_sa(session: AsyncSession, principal: Principal, row: Any, cls: type[ev.Event]) -> None:
    state = ev.ServiceAccountState(
        service_account_id=row.service_account_id,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        name=row.name,
        scopes=list(row.scopes),
        disabled=row.disabled,
    )
    await emit(
        session,
        cls.build(
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
) -> dict[str, Any]:
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
    await _emit_sa(session, principal, row, ev.ServiceAccountCreated)
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
    return {**_sa(row), "client_secret": secret}


async def list_service_accounts(session: AsyncSession, principal: Principal, project_id: uuid.UUID) -> list[dict]:
    await iam.authorize(session, principal, "identity.service_account.read", project_id=project_id)
    rows = await session.execute(
        select(service_accounts).where(service_accounts.c.project_id == project_id).order_by(service_accounts.c.name)
    )
    return [_sa(r) for r in rows]


async def _locked_sa(session: AsyncSession, principal: Principal, sa_id: uuid.UUID) -> Any:
    row = (
        await session.execute(
            select(service_accounts).where(service_accounts.c.service_account_id == sa_id).with_for_update()
        )
    ).first()
    if row is None:
        raise NotFound("service account not found", code="service_account_not_found")
    await iam.authorize(session, principal, "identity.service_account.manage", project_id=row.project_id)
    return row


async def rotate_service_account_secret(session: AsyncSession, principal: Principal, sa_id: uuid.UUID) -> dict:
    """A new secret replaces the old one at once; tokens already issued run out at their expiry."""
    row = await _locked_sa(session, principal, sa_id)
    secret = new_secret("sa")
    row = (
        await session.execute(
            update(service_accounts)
            .where(service_accounts.c.service_account_id == sa_id)
            .values(secret_hash=token_hash(secret), secret_rotated_at=func.now())
            .returning(*service_accounts.c)
        )
    ).one()
    await _emit_sa(session, principal, row, ev.ServiceAccountUpdated)
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
    return {**_sa(row), "client_secret": secret}


async def set_service_account_disabled(
    session: AsyncSession, principal: Principal, sa_id: uuid.UUID, disabled: bool
) -> dict[str, Any]:
    """Disabling denies the account in every service as soon as they apply the event (its tokens too)."""
    before = await _locked_sa(session, principal, sa_id)
    if before.disabled == disabled:
        return _sa(before)
    row = (
        await session.execute(
            update(service_accounts)
            .where(service_accounts.c.service_account_id == sa_id)
            .values(disabled=disabled)
            .returning(*service_accounts.c)
        )
    ).one()
    await _emit_sa(session, principal, row, ev.ServiceAccountDisabled if disabled else ev.ServiceAccountUpdated)
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
    return _sa(row)


# ----------------------------------------------------------------------------------- signing keys


async def rotate_signing_key(session: AsyncSession, principal: Principal) -> dict[str, Any]:
    """A new key signs from now on; the old ones stay in the JWKS until their tokens have expired."""
    await iam.authorize(session, principal, "identity.key.rotate")
    await session.execute(select(func.pg_advisory_xact_lock(7002)))
    retired = (
        await session.execute(
            update(signing_keys)
            .where(signing_keys.c.retired_at.is_(None))
            .values(retired_at=func.now())
            .returning(signing_keys.c.kid)
        )
    ).all()
    kid, private, public = keys.generate_key()
    await session.execute(insert(signing_keys).values(kid=kid, private_jwk=private, public_jwk=public))
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="identity.key.rotate",
        resource_type="signing_key",
        resource_id=kid,
        before={"active": [r[0] for r in retired]},
        after={"active": [kid]},
    )
    return {"kid": kid, "retired": [r[0] for r in retired]}
