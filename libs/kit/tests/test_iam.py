"""gpuaas.kit.iam against a real projection: roles, scopes, cross-tenant 404, revocation."""

from __future__ import annotations

import uuid

import pytest

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
async def world(infra):  # type: ignore[no-untyped-def]
    name, url = await new_service_db(infra.admin_url, "iam")
    engine = create_engine(url, name)
    sessions = session_factory(engine)
    w = {k: uuid.uuid4() for k in ("t1", "t2", "p1", "p2", "px", "op", "tadmin", "member", "viewer", "other", "sa")}
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


async def test_roles_decide_within_tenant_and_hide_other_tenants(world) -> None:  # type: ignore[no-untyped-def]
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


async def test_service_accounts_act_only_in_their_project_through_scopes(world) -> None:  # type: ignore[no-untyped-def]
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


async def test_revocation_denies_at_once_and_old_events_do_not_resurrect(world) -> None:  # type: ignore[no-untyped-def]
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
