"""gpuaas.kit.iam: the one permission table, the membership projection, and `authorize`.

Every service keeps a projection of identity's tenants, projects, users, memberships and service
accounts (fed by `gpuaas.identity.v1`), and decides access locally from it. A revoked membership
or a disabled service account therefore denies access as soon as the event is applied, without
waiting for token expiry.

Rules: platform_admin may do anything listed for it anywhere; tenant_admin anything listed for it in
its tenant; project roles apply to their project. A principal with no standing in the target tenant
gets 404 (existence is not revealed across tenants); standing but a missing permission gets 403.
Service accounts act only in their own project and only through their scopes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from sqlalchemy import and_, or_, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.events import identity as ev
from gpuaas.kit.auth import Principal, current_principal
from gpuaas.kit.errors import Forbidden, NotFound
from gpuaas.kit.subscriptions import Subscriptions
from gpuaas.kit.tables import iam_memberships, iam_projects, iam_service_accounts, iam_tenants, iam_users

P, T, PA, PM, V = (Role.platform_admin, Role.tenant_admin, Role.project_admin, Role.project_member, Role.viewer)
READ = frozenset({P, T, PA, PM, V})
WRITE = frozenset({P, T, PA, PM})
ADMIN = frozenset({P, T, PA})
TENANT_ADMIN = frozenset({P, T})
OPERATOR = frozenset({P})
SERVICE_ACCOUNT_ONLY: frozenset[Role] = frozenset()  # granted through scopes, never through a role

# action -> roles that may perform it. Keep actions `<service>.<resource>.<verb>` or `<service>.<verb>`.
PERMISSIONS: dict[str, frozenset[Role]] = {
    # identity
    "identity.tenant.create": OPERATOR,
    "identity.tenant.read": TENANT_ADMIN,
    "identity.tenant.update": TENANT_ADMIN,
    "identity.project.create": TENANT_ADMIN,
    "identity.project.read": READ,
    "identity.project.update": ADMIN,
    "identity.member.manage": ADMIN,
    "identity.service_account.manage": ADMIN,
    "identity.idp.manage": TENANT_ADMIN,
    "identity.audit.read": TENANT_ADMIN,
    "identity.user.read": TENANT_ADMIN,
    "identity.user.manage": TENANT_ADMIN,
    "identity.member.read": READ,
    "identity.service_account.read": ADMIN,
    "identity.platform_admin.manage": OPERATOR,
    "identity.key.rotate": OPERATOR,
    "identity.oauth_client.manage": OPERATOR,
    # allocations
    "allocations.read": READ,
    "allocations.create": WRITE,
    "allocations.update": WRITE,
    "allocations.release": WRITE,
    "allocations.ssh_grant.manage": ADMIN,
    "allocations.volume.manage": WRITE,
    "allocations.quota.manage": TENANT_ADMIN,
    "allocations.queue.manage": TENANT_ADMIN,  # a tenant's project queues (inside the tenant's share)
    "allocations.queue.operate": OPERATOR,  # tenant queues and the pool-wide queue view
    "allocations.host.manage": OPERATOR,
    "allocations.host.read": OPERATOR,
    # catalog
    "catalog.app.read": READ,
    "catalog.app.register": OPERATOR,
    "catalog.artifact.promote": OPERATOR,
    "catalog.entitlement.manage": OPERATOR,
    "catalog.artifact.register": OPERATOR,
    "catalog.artifact.read": OPERATOR,
    # app runtime
    "apps.instance.read": READ,
    "apps.instance.deploy": WRITE,
    "apps.instance.manage": ADMIN,
    "apps.instance.open": WRITE,  # a launchable app in the browser (code execution, like the terminal)
    "apps.member.add": WRITE,
    "apps.operation.manage": ADMIN,
    "apps.credential.rotate": ADMIN,
    "apps.controller": SERVICE_ACCOUNT_ONLY,
    "apps.credential.fetch": SERVICE_ACCOUNT_ONLY,
    "metering.usage.write": SERVICE_ACCOUNT_ONLY,
    # metering / billing
    "metering.usage.read": READ,
    "metering.usage.backfill": OPERATOR,
    "billing.read": frozenset({P, T, PA}),
    "billing.price.manage": OPERATOR,
    "billing.budget.manage": TENANT_ADMIN,
    "billing.breakdown.read": OPERATOR,
    "billing.statement.close": OPERATOR,
    # every service: operator admin surface (dead letters, outbox replay)
    "platform.admin": OPERATOR,
}

# service-account scope -> actions it may perform (only ever inside its own project).
SCOPE_ACTIONS: dict[str, frozenset[str]] = {
    "app-controller": frozenset(
        {
            "apps.instance.read",
            "apps.controller",
            "apps.member.add",
            "apps.credential.fetch",
            "allocations.read",
            "metering.usage.write",
            "catalog.app.read",
        }
    ),
    "allocations": frozenset({"allocations.read", "allocations.create", "allocations.update", "allocations.release"}),
    "read": frozenset(
        {"allocations.read", "apps.instance.read", "catalog.app.read", "identity.project.read", "metering.usage.read"}
    ),
}


def roles_allowed(action: str) -> frozenset[Role]:
    try:
        return PERMISSIONS[action]
    except KeyError:
        raise KeyError(f"unknown action {action!r}: add it to gpuaas.kit.iam.PERMISSIONS") from None


async def project_tenant(session: AsyncSession, project_id: uuid.UUID) -> uuid.UUID | None:
    row = (
        await session.execute(
            select(iam_projects.c.tenant_id).where(
                iam_projects.c.project_id == project_id, iam_projects.c.archived.is_(False)
            )
        )
    ).first()
    return row[0] if row else None


async def _active_roles(session: AsyncSession, user_id: uuid.UUID) -> list[Any]:
    user = (await session.execute(select(iam_users.c.status).where(iam_users.c.user_id == user_id))).first()
    if user is not None and user.status != "active":
        return []
    return list(
        (
            await session.execute(
                select(
                    iam_memberships.c.scope,
                    iam_memberships.c.role,
                    iam_memberships.c.tenant_id,
                    iam_memberships.c.project_id,
                ).where(iam_memberships.c.user_id == user_id, iam_memberships.c.revoked.is_(False))
            )
        ).all()
    )


async def is_platform_admin(session: AsyncSession, principal: Principal) -> bool:
    if principal.is_service_account:
        return False
    return any(
        m.scope == MembershipScope.platform and m.role == Role.platform_admin
        for m in await _active_roles(session, principal.subject)
    )


async def authorize(
    session: AsyncSession,
    principal: Principal,
    action: str,
    *,
    tenant_id: uuid.UUID | None = None,
    project_id: uuid.UUID | None = None,
) -> None:
    """Raise NotFound/Forbidden unless `principal` may perform `action` on the target scope."""
    allowed = roles_allowed(action)
    if project_id is not None:
        owner = await project_tenant(session, project_id)
        if owner is None:
            raise NotFound("project not found", code="project_not_found")
        if tenant_id is not None and tenant_id != owner:
            raise NotFound("project not found", code="project_not_found")
        tenant_id = owner

    if principal.is_service_account:
        await _authorize_service_account(session, principal, action, tenant_id, project_id)
        return

    memberships = await _active_roles(session, principal.subject)
    if any(m.scope == MembershipScope.platform and m.role == Role.platform_admin for m in memberships):
        if P in allowed:
            return
        raise permission_denied(f"operators may not {action}", action, allowed)
    if tenant_id is None:
        if P in allowed:
            raise permission_denied(f"{action} is reserved to platform operators", action, allowed)
        return  # a tenant-less action open to every authenticated user
    in_tenant = [m for m in memberships if m.tenant_id == tenant_id]
    if not in_tenant:
        raise NotFound("not found", code="not_found")
    roles = {Role(m.role) for m in in_tenant if m.scope == MembershipScope.tenant}
    if project_id is not None:
        roles |= {Role(m.role) for m in in_tenant if m.scope == MembershipScope.project and m.project_id == project_id}
        if not roles:
            raise NotFound("project not found", code="project_not_found")
    if roles & allowed:
        return
    raise permission_denied(f"your role does not allow {action}", action, allowed)


def permission_denied(detail: str, action: str, allowed: frozenset[Role]) -> Forbidden:
    """403 `permission_denied`, naming the permission and the roles that hold it (stable extra fields
    `permission` and `roles`, in the order of `Role`) so the caller knows whom to ask."""
    roles = [r.value for r in Role if r in allowed]
    held_by = f"; held by {', '.join(roles)}" if roles else "; no role holds it (service accounts only)"
    return Forbidden(detail + held_by, code="permission_denied", permission=action, roles=roles)


async def _authorize_service_account(
    session: AsyncSession, principal: Principal, action: str, tenant_id: uuid.UUID | None, project_id: uuid.UUID | None
) -> None:
    sa = (
        await session.execute(
            select(iam_service_accounts).where(iam_service_accounts.c.service_account_id == principal.subject)
        )
    ).first()
    if sa is None or sa.disabled:
        raise Forbidden("this service account is disabled or unknown", code="service_account_disabled")
    if project_id is None or project_id != sa.project_id:
        raise NotFound("not found", code="not_found")
    granted = set[str]().union(*(SCOPE_ACTIONS.get(s, frozenset()) for s in sa.scopes if s in principal.scopes))
    if action not in granted:
        raise Forbidden(f"the service account's scopes do not allow {action}", code="insufficient_scope")


async def visible_project_ids(session: AsyncSession, principal: Principal) -> set[uuid.UUID] | None:
    """Projects the principal may read; None means all (operator)."""
    if principal.is_service_account:
        return {principal.project_id} if principal.project_id else set()
    memberships = await _active_roles(session, principal.subject)
    if any(m.scope == MembershipScope.platform for m in memberships):
        return None
    tenants = [m.tenant_id for m in memberships if m.scope == MembershipScope.tenant]
    ids = {m.project_id for m in memberships if m.scope == MembershipScope.project}
    if tenants:
        rows = await session.execute(select(iam_projects.c.project_id).where(iam_projects.c.tenant_id.in_(tenants)))
        ids |= {r[0] for r in rows}
    return ids


def require(action: str) -> Callable[[Request], Coroutine[Any, Any, Principal]]:
    """FastAPI dependency: authenticate, then authorize `action` against path params
    `project_id`/`tenant_id` when present (use `authorize` in the use case for body-scoped targets)."""

    async def dependency(request: Request) -> Principal:
        principal = await current_principal(request)
        params = request.path_params
        project_id = _uuid_or_404(params.get("project_id"))
        tenant_id = _uuid_or_404(params.get("tenant_id"))
        async with request.app.state.kit.sessions() as session:
            await authorize(session, principal, action, tenant_id=tenant_id, project_id=project_id)
        return principal

    dependency.__dict__["__gpuaas_action__"] = action  # read by `route_actions`
    return dependency


ACTION_EXTENSION = "x-gpuaas-action"


def action_doc(action: str) -> dict[str, Any]:
    """`openapi_extra` for a route that authorizes `action` in its body rather than with `require()`:
    publishes the action in the OpenAPI (read by the permission-matrix test)."""
    roles_allowed(action)  # fail at import for an action the table does not know
    return {ACTION_EXTENSION: action}


def route_actions(router: Any) -> None:
    """Publish each route's permission action in its OpenAPI operation (`x-gpuaas-action`), taken from
    its `require(action)` dependency unless the route already declares one. The permission-matrix test
    reads it through the gateway's aggregated /openapi.json."""
    from fastapi.routing import APIRoute

    def find(dependant: Any) -> str | None:
        for dep in dependant.dependencies:
            action = getattr(dep.call, "__gpuaas_action__", None) or find(dep)
            if action:
                return action
        return None

    for route in router.routes:
        if not isinstance(route, APIRoute):
            continue
        extra = dict(route.openapi_extra or {})
        if ACTION_EXTENSION in extra:
            continue
        if action := find(route.dependant):
            extra[ACTION_EXTENSION] = action
            route.openapi_extra = extra


def _uuid_or_404(value: str | None) -> uuid.UUID | None:
    if value is None:
        return None
    try:
        return uuid.UUID(value)
    except ValueError:
        raise NotFound("not found") from None


# --- projection consumer (identical in every service) ---

subscriptions = Subscriptions()


async def _upsert(session: AsyncSession, table: Any, key: str, values: dict[str, Any], event: ev.Event) -> None:
    """Keep the newest state of a record: ordered by the producer's per-record `sequence` (identity's
    outbox numbers its events in commit order), never by clock time, so a clock step cannot drop a revoke.

    An event without a sequence (published before sequences existed) falls back to event time, and only
    over state that has no sequence either; once a record holds a sequenced state, unsequenced events
    (older by construction) never overwrite it.
    """
    values = {**values, "updated_at": event.time, "version": event.sequence}
    stmt = pg_insert(table).values(values)
    if event.sequence is not None:
        newer = or_(table.c.version.is_(None), table.c.version < stmt.excluded.version)
    else:
        newer = and_(table.c.version.is_(None), table.c.updated_at <= stmt.excluded.updated_at)
    stmt = stmt.on_conflict_do_update(
        index_elements=[key], set_={k: stmt.excluded[k] for k in values if k != key}, where=newer
    )
    await session.execute(stmt)


@subscriptions.on(ev.TenantCreated, ev.TenantUpdated)
async def _tenant(session: AsyncSession, e: ev.TenantCreated) -> None:
    await _upsert(session, iam_tenants, "tenant_id", e.data.model_dump(), e)


@subscriptions.on(ev.ProjectCreated, ev.ProjectUpdated)
async def _project(session: AsyncSession, e: ev.ProjectCreated) -> None:
    await _upsert(session, iam_projects, "project_id", e.data.model_dump(), e)


@subscriptions.on(ev.UserCreated, ev.UserUpdated)
async def _user(session: AsyncSession, e: ev.UserCreated) -> None:
    d = e.data
    await _upsert(
        session,
        iam_users,
        "user_id",
        {"user_id": d.user_id, "email": d.email, "tenant_id": d.tenant_id, "status": d.status},
        e,
    )


@subscriptions.on(ev.MembershipGranted, ev.MembershipChanged, ev.MembershipRevoked)
async def _membership(
    session: AsyncSession, e: ev.MembershipGranted | ev.MembershipChanged | ev.MembershipRevoked
) -> None:
    d = e.data
    values = d.model_dump()
    values["scope"], values["role"] = str(d.scope), str(d.role)
    values["revoked"] = d.revoked or e.type == "membership.revoked"
    await _upsert(session, iam_memberships, "membership_id", values, e)


@subscriptions.on(ev.ServiceAccountCreated, ev.ServiceAccountUpdated, ev.ServiceAccountDisabled)
async def _service_account(
    session: AsyncSession, e: ev.ServiceAccountCreated | ev.ServiceAccountUpdated | ev.ServiceAccountDisabled
) -> None:
    values = e.data.model_dump()
    values["disabled"] = e.data.disabled or e.type == "service_account.disabled"
    await _upsert(session, iam_service_accounts, "service_account_id", values, e)


async def apply_locally(session: AsyncSession, event: ev.Event) -> None:
    """Apply an identity event to this service's projection now (identity itself, in the same
    transaction that emits it); the copy that later arrives from the topic is a no-op."""
    for handler in subscriptions.handlers.get(event.type, []):
        await handler(session, event)
