"""gpuaas.kit.iam against a real projection: roles, scopes, cross-tenant 404, revocation."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.contracts import ActorKind, Event
from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.events import identity as ev
from gpuaas.kit.auth import Principal
from gpuaas.kit.db import create_engine, session_factory
from gpuaas.kit.errors import Forbidden, NotFound
from gpuaas.kit.iam import PERMISSIONS, SCOPE_ACTIONS, apply_locally, authorize, visible_project_ids
from gpuaas.kit.testing import new_service_db

pytestmark = pytest.mark.integration


def operator_events(user_id: uuid.UUID) -> list[Event]:
    m = ev.MembershipState(
        membership_id=uuid.uuid4(), user_id=user_id, scope=MembershipScope.platform, role=Role.platform_admin
    )
    return [ev.MembershipGranted.build(subject=m.membership_id, data=m, source="identity")]


def membership(
    user: uuid.UUID, role: Role, tenant: uuid.UUID, project: uuid.UUID | None = None, revoked: bool = False
) -> Event:
    scope = MembershipScope.project if project else MembershipScope.tenant
    m = ev.MembershipState(
        membership_id=uuid.uuid4(),
        user_id=user,
        scope=scope,
        role=role,
        tenant_id=tenant,
        project_id=project,
        revoked=revoked,
    )
    cls = ev.MembershipRevoked if revoked else ev.MembershipGranted
    return cls.build(subject=m.membership_id, data=m, source="identity")


def user(uid: uuid.UUID) -> Principal:
    return Principal(subject=uid, kind=ActorKind.user)


@pytest.fixture
async def world(infra):
    name, url = await new_service_db(infra.admin_url, "iam")
    engine = create_engine(url, name)
    sessions = session_factory(engine)
    names = ("t1", "t2", "p1", "p2", "px", "op", "tadmin", "padmin", "member", "viewer", "other", "sa")
    w = {k: uuid.uuid4() for k in names}
    events: list[Event] = [
        *operator_events(w["op"]),
        ev.TenantCreated.build(
            subject=w["t1"], source="identity", data=ev.TenantState(tenant_id=w["t1"], slug="t1", name="T1")
        ),
        ev.ProjectCreated.build(
            subject=w["p1"], source="identity", data=ev.ProjectState(project_id=w["p1"], tenant_id=w["t1"], name="p1")
        ),
        ev.ProjectCreated.build(
            subject=w["p2"], source="identity", data=ev.ProjectState(project_id=w["p2"], tenant_id=w["t1"], name="p2")
        ),
        ev.ProjectCreated.build(
            subject=w["px"], source="identity", data=ev.ProjectState(project_id=w["px"], tenant_id=w["t2"], name="px")
        ),
        membership(w["tadmin"], Role.tenant_admin, w["t1"]),
        membership(w["padmin"], Role.project_admin, w["t1"], w["p1"]),
        membership(w["member"], Role.project_member, w["t1"], w["p1"]),
        membership(w["viewer"], Role.viewer, w["t1"], w["p1"]),
        membership(w["other"], Role.tenant_admin, w["t2"]),
        ev.ServiceAccountCreated.build(
            subject=w["sa"],
            source="identity",
            data=ev.ServiceAccountState(
                service_account_id=w["sa"], tenant_id=w["t1"], project_id=w["p1"], name="ctl", scopes=["app-controller"]
            ),
        ),
    ]
    async with sessions() as s, s.begin():
        for e in events:
            await apply_locally(s, e)
    yield w, sessions
    await engine.dispose()


async def test_roles_decide_within_tenant_and_hide_other_tenants(world) -> None:
    w, sessions = world
    async with sessions() as s:
        await authorize(s, user(w["op"]), "allocations.host.manage")
        await authorize(s, user(w["tadmin"]), "allocations.create", project_id=w["p2"])
        await authorize(s, user(w["member"]), "allocations.create", project_id=w["p1"])
        await authorize(s, user(w["viewer"]), "allocations.read", project_id=w["p1"])
        with pytest.raises(Forbidden):
            await authorize(s, user(w["viewer"]), "allocations.create", project_id=w["p1"])
        with pytest.raises(NotFound):  # member of p1 only: p2 does not exist for them
            await authorize(s, user(w["member"]), "allocations.read", project_id=w["p2"])
        with pytest.raises(NotFound):  # another tenant's admin
            await authorize(s, user(w["other"]), "allocations.read", project_id=w["p1"])
        with pytest.raises(Forbidden):  # operator-only action
            await authorize(s, user(w["tadmin"]), "allocations.host.manage")
        with pytest.raises(NotFound):
            await authorize(s, user(w["member"]), "allocations.read", project_id=uuid.uuid4())
        assert await visible_project_ids(s, user(w["tadmin"])) == {w["p1"], w["p2"]}
        assert await visible_project_ids(s, user(w["member"])) == {w["p1"]}
        assert await visible_project_ids(s, user(w["op"])) is None


async def test_service_accounts_act_only_in_their_project_through_scopes(world) -> None:
    w, sessions = world
    sa = Principal(
        subject=w["sa"], kind=ActorKind.service_account, project_id=w["p1"], scopes=frozenset({"app-controller"})
    )
    async with sessions() as s:
        await authorize(s, sa, "apps.controller", project_id=w["p1"])
        with pytest.raises(NotFound):
            await authorize(s, sa, "apps.controller", project_id=w["p2"])
        with pytest.raises(Forbidden):
            await authorize(s, sa, "allocations.create", project_id=w["p1"])
        unscoped = Principal(subject=w["sa"], kind=ActorKind.service_account, project_id=w["p1"])
        with pytest.raises(Forbidden):  # token did not ask for the scope
            await authorize(s, unscoped, "apps.controller", project_id=w["p1"])
    disabled = ev.ServiceAccountDisabled.build(
        subject=w["sa"],
        source="identity",
        data=ev.ServiceAccountState(
            service_account_id=w["sa"],
            tenant_id=w["t1"],
            project_id=w["p1"],
            name="ctl",
            scopes=["app-controller"],
            disabled=True,
        ),
    )
    async with sessions() as s, s.begin():
        await apply_locally(s, disabled)
    async with sessions() as s:
        with pytest.raises(Forbidden):
            await authorize(s, sa, "apps.controller", project_id=w["p1"])


async def test_revocation_denies_at_once_and_old_events_do_not_resurrect(world) -> None:
    w, sessions = world
    grant = membership(w["member"], Role.project_admin, w["t1"], w["p2"])
    revoke = ev.MembershipRevoked.build(
        subject=grant.subject, source="identity", data=grant.data.model_copy(update={"revoked": True})
    )
    async with sessions() as s, s.begin():
        await apply_locally(s, grant)
    async with sessions() as s:
        await authorize(s, user(w["member"]), "allocations.create", project_id=w["p2"])
    async with sessions() as s, s.begin():
        await apply_locally(s, revoke)
        await apply_locally(s, grant)  # a replayed, older grant arrives late: last writer by event time wins
    async with sessions() as s:
        with pytest.raises(NotFound):
            await authorize(s, user(w["member"]), "allocations.create", project_id=w["p2"])


def test_every_role_action_includes_operators_and_every_scope_action_exists() -> None:
    for action, roles in PERMISSIONS.items():
        assert roles <= set(Role), action
        assert not roles or Role.platform_admin in roles, action
    for scope, actions in SCOPE_ACTIONS.items():
        assert actions <= set(PERMISSIONS), scope


# --- the high-risk decisions, pinned by hand -------------------------------------------------------
# Everything above and the e2e matrix derive their expectations from PERMISSIONS, the table enforcement
# reads: a wrong entry there would be "expected" too. These are written out literally instead, so widening
# or narrowing one of them needs a deliberate change here as well.

OPERATOR_ONLY = {Role.platform_admin}
PINNED_ROLES: dict[str, set[Role]] = {
    "identity.tenant.create": OPERATOR_ONLY,
    "identity.platform_admin.manage": OPERATOR_ONLY,
    "identity.key.rotate": OPERATOR_ONLY,
    "identity.oauth_client.manage": OPERATOR_ONLY,
    "allocations.host.manage": OPERATOR_ONLY,
    "allocations.host.read": OPERATOR_ONLY,
    "catalog.app.register": OPERATOR_ONLY,
    "catalog.artifact.register": OPERATOR_ONLY,
    "catalog.artifact.promote": OPERATOR_ONLY,
    "catalog.entitlement.manage": OPERATOR_ONLY,
    "metering.usage.backfill": OPERATOR_ONLY,
    "billing.price.manage": OPERATOR_ONLY,
    "billing.statement.close": OPERATOR_ONLY,
    "billing.breakdown.read": OPERATOR_ONLY,
    "platform.admin": OPERATOR_ONLY,
    "allocations.quota.manage": {Role.platform_admin, Role.tenant_admin},
    "allocations.queue.manage": {Role.platform_admin, Role.tenant_admin},
    "allocations.queue.operate": OPERATOR_ONLY,
    "billing.budget.manage": {Role.platform_admin, Role.tenant_admin},
    "identity.idp.manage": {Role.platform_admin, Role.tenant_admin},
    "identity.user.manage": {Role.platform_admin, Role.tenant_admin},
    "billing.read": {Role.platform_admin, Role.tenant_admin, Role.project_admin},
    "identity.service_account.manage": {Role.platform_admin, Role.tenant_admin, Role.project_admin},
    "identity.member.manage": {Role.platform_admin, Role.tenant_admin, Role.project_admin},
    "allocations.ssh_grant.manage": {Role.platform_admin, Role.tenant_admin, Role.project_admin},
    "apps.credential.rotate": {Role.platform_admin, Role.tenant_admin, Role.project_admin},
    "allocations.release": {Role.platform_admin, Role.tenant_admin, Role.project_admin, Role.project_member},
    "allocations.create": {Role.platform_admin, Role.tenant_admin, Role.project_admin, Role.project_member},
    # granted through a service account's scopes only, never through a role (not even an operator's)
    "apps.controller": set(),
    "apps.credential.fetch": set(),
    "metering.usage.write": set(),
}


def test_high_risk_actions_grant_exactly_the_pinned_roles() -> None:
    drifted = {a: sorted(PERMISSIONS[a]) for a, roles in PINNED_ROLES.items() if set(PERMISSIONS[a]) != roles}
    assert not drifted, f"PERMISSIONS changed for high-risk actions (update PINNED_ROLES deliberately): {drifted}"


def test_scopes_never_reach_secrets_money_or_operator_actions() -> None:
    assert SCOPE_ACTIONS["app-controller"] == {
        "apps.instance.read",
        "apps.controller",
        "apps.member.add",
        "apps.credential.fetch",
        "allocations.read",
        "metering.usage.write",
        "catalog.app.read",
    }
    assert SCOPE_ACTIONS["allocations"] == {
        "allocations.read",
        "allocations.create",
        "allocations.update",
        "allocations.release",
    }
    risky = {a for a, roles in PINNED_ROLES.items() if roles and roles <= {Role.platform_admin, Role.tenant_admin}}
    risky |= {
        "identity.service_account.manage",
        "identity.member.manage",
        "allocations.ssh_grant.manage",
        "billing.read",
    }
    for scope, actions in SCOPE_ACTIONS.items():
        assert not actions & risky, (scope, sorted(actions & risky))


# Who asks, in this order: operator, t1's tenant admin, p1's project admin, p1's member, p1's viewer, and
# t2's tenant admin. "ok" = allowed, 403 = Forbidden, 404 = NotFound (no standing in t1).
WHO = ("op", "tadmin", "padmin", "member", "viewer", "other")
PINNED_DECISIONS: dict[tuple[str, str], str] = {
    # platform actions (no tenant): operators only, everyone else 403
    ("billing.statement.close", "platform"): "ok  403 403 403 403 403",
    ("billing.price.manage", "platform"): "ok  403 403 403 403 403",
    ("identity.tenant.create", "platform"): "ok  403 403 403 403 403",
    ("identity.platform_admin.manage", "platform"): "ok  403 403 403 403 403",
    ("identity.key.rotate", "platform"): "ok  403 403 403 403 403",
    ("allocations.host.manage", "platform"): "ok  403 403 403 403 403",
    ("allocations.queue.operate", "platform"): "ok  403 403 403 403 403",
    ("allocations.queue.operate", "tenant"): "ok  403 403 403 403 404",
    ("catalog.artifact.promote", "platform"): "ok  403 403 403 403 403",
    ("catalog.entitlement.manage", "platform"): "ok  403 403 403 403 403",
    ("platform.admin", "platform"): "ok  403 403 403 403 403",
    # tenant t1: its tenant admin (and operators); a project role gives nothing at the tenant
    ("billing.budget.manage", "tenant"): "ok  ok  403 403 403 404",
    ("allocations.queue.manage", "tenant"): "ok  ok  403 403 403 404",
    ("identity.idp.manage", "tenant"): "ok  ok  403 403 403 404",
    ("identity.user.manage", "tenant"): "ok  ok  403 403 403 404",
    # project p1
    ("allocations.quota.manage", "project"): "ok  ok  403 403 403 404",
    ("allocations.queue.manage", "project"): "ok  ok  403 403 403 404",
    ("billing.read", "project"): "ok  ok  ok  403 403 404",
    ("identity.service_account.manage", "project"): "ok  ok  ok  403 403 404",
    ("identity.member.manage", "project"): "ok  ok  ok  403 403 404",
    ("allocations.ssh_grant.manage", "project"): "ok  ok  ok  403 403 404",
    ("apps.credential.rotate", "project"): "ok  ok  ok  403 403 404",
    ("allocations.release", "project"): "ok  ok  ok  ok  403 404",
    ("allocations.create", "project"): "ok  ok  ok  ok  403 404",
    ("allocations.read", "project"): "ok  ok  ok  ok  ok  404",
    # scope-only actions: no role, not even an operator's
    ("apps.controller", "project"): "403 403 403 403 403 404",
    ("apps.credential.fetch", "project"): "403 403 403 403 403 404",
}


async def _decision(session: AsyncSession, principal: Principal, action: str, **target: uuid.UUID) -> str:
    try:
        await authorize(session, principal, action, **target)
    except NotFound:
        return "404"
    except Forbidden:
        return "403"
    return "ok"


async def test_high_risk_decisions_are_the_pinned_ones(world) -> None:
    w, sessions = world
    targets = {"platform": {}, "tenant": {"tenant_id": w["t1"]}, "project": {"project_id": w["p1"]}}
    wrong = []
    async with sessions() as s:
        for (action, where), row in PINNED_DECISIONS.items():
            for who, want in zip(WHO, row.split(), strict=True):
                got = await _decision(s, user(w[who]), action, **targets[where])
                if got != want:
                    wrong.append(f"{who:7} {action} on {where}: expected {want}, got {got}")
    assert not wrong, "\n".join(wrong)


async def test_service_accounts_never_get_high_risk_actions_in_their_own_project(world) -> None:
    w, sessions = world
    every_scope = Principal(
        subject=w["sa"],
        kind=ActorKind.service_account,
        project_id=w["p1"],
        scopes=frozenset({"app-controller", "allocations", "read"}),
    )
    async with sessions() as s:
        for action in (
            "identity.service_account.manage",
            "identity.member.manage",
            "allocations.ssh_grant.manage",
            "allocations.release",  # the app-controller scope it holds does not include it
            "billing.read",
            "billing.budget.manage",
            "platform.admin",
        ):
            assert await _decision(s, every_scope, action, project_id=w["p1"]) == "403", action
