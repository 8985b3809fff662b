"""Issue 19: `POST /tenants/{t}/users {"role": "project_admin"}` made a tenant-scope project_admin (admin of
no named project, yet of every one). A project role on a new user names its project (`project_id`, and the
membership is project-scoped there); project_admin without a project is a 422 `project_required`."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import text

from .conftest import PASSWORD, Identity

pytestmark = pytest.mark.integration


async def memberships_of(identity: Identity, email: str) -> list[tuple[str, str, str | None]]:
    async with identity.kit.sessions() as s:
        rows = await s.execute(
            text(
                "SELECT m.scope, m.role, m.project_id FROM memberships m JOIN users u USING (user_id) "
                "WHERE lower(u.email) = lower(:e)"
            ),
            {"e": email},
        )
        return [(r.scope, r.role, str(r.project_id) if r.project_id else None) for r in rows]


async def test_a_new_project_admin_names_its_project(identity: Identity) -> None:
    w = await identity.tenant()
    tid, pid, admin = w["tenant_id"], w["project_id"], w["tenant_admin"]
    email = f"pa-{uuid.uuid4().hex[:6]}@{w['slug']}.example"

    r = await identity.client.post(
        f"/tenants/{tid}/users", json={"email": email, "password": PASSWORD, "role": "project_admin"}, headers=admin
    )
    assert r.status_code == 422, r.text  # was 201 with a tenant-scope project_admin
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["code"] == "project_required"
    assert await memberships_of(identity, email) == []  # no partial write: no user either
    async with identity.kit.sessions() as s:
        assert await s.scalar(text("SELECT count(*) FROM users WHERE lower(email) = lower(:e)"), {"e": email}) == 0

    # with its project: a project-scoped membership there
    r = await identity.client.post(
        f"/tenants/{tid}/users",
        json={"email": email, "password": PASSWORD, "role": "project_admin", "project_id": pid},
        headers=admin,
    )
    assert r.status_code == 201, r.text
    assert r.json()["membership_id"]
    assert await memberships_of(identity, email) == [("project", "project_admin", pid)]
    token = await identity.login(email)
    me = (await identity.client.get("/me", headers={"Authorization": f"Bearer {token['access_token']}"})).json()
    assert [(m["role"], m.get("project_id")) for m in me["memberships"]] == [("project_admin", pid)]

    # a project of another tenant, a tenant role with a project, an unknown project: refused, nothing written
    other = await identity.tenant()
    for body, status, code in (
        ({"role": "project_member", "project_id": other["project_id"]}, 404, "project_not_found"),
        ({"role": "viewer", "project_id": str(uuid.uuid4())}, 404, "project_not_found"),
        ({"role": "tenant_admin", "project_id": pid}, 422, "invalid_role"),
    ):
        e = f"x-{uuid.uuid4().hex[:6]}@{w['slug']}.example"
        r = await identity.client.post(
            f"/tenants/{tid}/users", json={"email": e, "password": PASSWORD, **body}, headers=admin
        )
        assert (r.status_code, r.json()["code"]) == (status, code), r.text
        assert await memberships_of(identity, e) == []
    # tenant-wide roles keep working as before
    e = f"v-{uuid.uuid4().hex[:6]}@{w['slug']}.example"
    r = await identity.client.post(
        f"/tenants/{tid}/users", json={"email": e, "password": PASSWORD, "role": "viewer"}, headers=admin
    )
    assert r.status_code == 201 and await memberships_of(identity, e) == [("tenant", "viewer", None)]
