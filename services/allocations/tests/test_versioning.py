"""Optimistic concurrency on allocations (ARCHITECTURE §11): GET answers the version as `ETag`; restart,
resize, release, retry-release, volume attach/detach and grant create/revoke accept `If-Match`, checked
under the allocation's row lock. A stale one is 412 `version_mismatch` and changes nothing (row, timeline,
tasks, grants, volumes, outbox); the current one succeeds and the response carries the new `ETag`.
The checks every versioned service shares are gpuaas.kit.testing_versioning's; this file says what to send."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sqlalchemy import text

from gpuaas.kit.testing import wait_for
from gpuaas.kit.testing_versioning import (
    assert_all_malformed_rejected,
    assert_all_stale,
    assert_version_mismatch,
    etag_version,
    exactly_one_wins,
    if_match,
    version_of,
)

from .conftest import World, ssh_key

pytestmark = pytest.mark.integration


async def _rows(s: Any, sql: str, **params: Any) -> list[dict[str, Any]]:
    return [dict(r._mapping) for r in await s.execute(text(sql), params)]


async def stored(w: World, aid: str) -> dict[str, Any]:
    """Everything a change of the allocation could write, read straight from its schema."""
    async with w.kit.sessions() as s:
        return {
            "allocation": await _rows(s, "SELECT * FROM allocations WHERE allocation_id = :a", a=aid),
            "timeline": await _rows(s, "SELECT * FROM timeline WHERE allocation_id = :a ORDER BY seq", a=aid),
            "tasks": await _rows(
                s, "SELECT task_id, kind, status FROM agent_tasks WHERE allocation_id = :a ORDER BY seq", a=aid
            ),
            "grants": await _rows(s, "SELECT * FROM ssh_grants WHERE allocation_id = :a ORDER BY created_at", a=aid),
            "attachments": await _rows(s, "SELECT * FROM volume_attachments WHERE allocation_id = :a", a=aid),
            "volumes": await _rows(s, "SELECT * FROM volumes ORDER BY created_at"),
            "gpus": await _rows(s, "SELECT * FROM gpu_assignments WHERE allocation_id = :a ORDER BY gpu_index", a=aid),
            "outbox": await _rows(s, "SELECT seq, event_type, aggregate_id FROM outbox ORDER BY seq"),
        }


async def settled(w: World, aid: str) -> None:
    """No agent task of the allocation is still pending or leased (so nothing changes it meanwhile)."""

    async def idle() -> bool:
        async with w.kit.sessions() as s:
            n = await s.execute(
                text("SELECT count(*) FROM agent_tasks WHERE allocation_id = :a AND status IN ('pending', 'leased')"),
                {"a": aid},
            )
            return n.scalar_one() == 0

    await wait_for(idle, 30, f"agent tasks of {aid} done")


async def version(c: httpx.AsyncClient, aid: str) -> int:
    """The allocation's version, as its GET answers it (body and ETag)."""
    return await version_of(c, f"/allocations/{aid}")


async def test_stale_if_match_changes_nothing_and_the_current_one_succeeds(world: World) -> None:
    w = world
    await w.host_with_agent("gpu-1", "8xH100-80GB")
    _, grantee_pub = ssh_key()
    _, other_pub = ssh_key()
    async with w.client("owner") as c:
        data, scratch = [
            (await c.post(f"/projects/{w.ids['p1']}/volumes", json={"name": n, "size_gb": 1})).json()
            for n in ("data", "scratch")
        ]
        r = await w.create("owner", gpu_count=1)
        assert r.status_code == 201, r.text
        etag_version(r)
        aid = r.json()["allocation_id"]
        await w.wait_status("owner", aid, "active")
        await settled(w, aid)

        # Attaching moves the version on (the volume ids are part of the allocation); a grant does not.
        v = await version(c, aid)
        r = await c.post(f"/allocations/{aid}/volumes", json={"volume_id": data["volume_id"]}, headers=if_match(v))
        assert r.status_code == 201, r.text
        v_attached = await version(c, aid)
        assert v_attached == v + 1 and r.headers["etag"] == f'"{v_attached}"'
        r = await c.post(
            f"/allocations/{aid}/ssh-grants",
            json={"user_id": str(w.ids["grantee"]), "public_key": grantee_pub},
            headers=if_match(v_attached),
        )
        assert r.status_code == 201 and r.headers["etag"] == f'"{v_attached}"', r.text
        grant_id = r.json()["grant_id"]
        await settled(w, aid)

        # Every change sent with the version before the attachment: 412, and nothing stored moves.
        stale = if_match(v)
        await assert_all_stale(
            lambda: stored(w, aid),
            [
                ("restart", lambda: c.post(f"/allocations/{aid}/restart", headers=stale)),
                ("resize", lambda: c.post(f"/allocations/{aid}/resize", json={"gpu_count": 2}, headers=stale)),
                ("release", lambda: c.post(f"/allocations/{aid}/release", headers=stale)),
                ("retry-release", lambda: c.post(f"/allocations/{aid}/retry-release", headers=stale)),
                (
                    "attach",
                    lambda: c.post(
                        f"/allocations/{aid}/volumes", json={"volume_id": scratch["volume_id"]}, headers=stale
                    ),
                ),
                ("detach", lambda: c.delete(f"/allocations/{aid}/volumes/{data['volume_id']}", headers=stale)),
                (
                    "grant",
                    lambda: c.post(
                        f"/allocations/{aid}/ssh-grants",
                        json={"user_id": str(w.ids["grantee"]), "public_key": other_pub},
                        headers=stale,
                    ),
                ),
                ("revoke", lambda: c.delete(f"/allocations/{aid}/ssh-grants/{grant_id}", headers=stale)),
                # A weak tag of a stale version is as stale.
                ("weak restart", lambda: c.post(f"/allocations/{aid}/restart", headers=if_match(f'W/"{v}"'))),
            ],
        )
        assert (await version(c, aid)) == v_attached

        # The current version succeeds, and each response carries the version it left behind.
        r = await c.post(f"/allocations/{aid}/restart", headers=if_match(v_attached))
        assert r.status_code == 202 and r.json()["status"] == "restarting", r.text
        assert etag_version(r) == v_attached + 1
        await w.wait_status("owner", aid, "active")
        await settled(w, aid)
        v = await version(c, aid)
        r = await c.delete(f"/allocations/{aid}/ssh-grants/{grant_id}", headers=if_match(v))
        assert r.status_code == 200 and r.json()["status"] == "revoked" and r.headers["etag"] == f'"{v}"', r.text
        r = await c.delete(f"/allocations/{aid}/volumes/{data['volume_id']}", headers=if_match(v))
        assert r.status_code == 200 and r.json()["attachments"] == [], r.text
        v = await version(c, aid)
        assert r.headers["etag"] == f'"{v}"'
        r = await c.post(f"/allocations/{aid}/resize", json={"gpu_count": 2}, headers=if_match(v))
        assert r.status_code == 202 and r.json()["target_gpu_count"] == 2, r.text
        await w.wait_status("owner", aid, "active")
        await settled(w, aid)
        r = await c.post(f"/allocations/{aid}/release", headers=if_match(await version(c, aid)))
        assert r.status_code == 202, r.text
        etag_version(r)
        await w.wait_status("owner", aid, "released")


async def test_two_resizes_with_one_if_match_exactly_one_wins(world: World) -> None:
    w = world
    await w.host_with_agent("gpu-1", "8xH100-80GB")
    aid = (await w.create("owner", gpu_count=1)).json()["allocation_id"]
    await w.wait_status("owner", aid, "active")
    await settled(w, aid)
    async with w.client("owner") as c1, w.client("owner") as c2:
        v = await version(c1, aid)
        winner, _ = await exactly_one_wins(
            202,
            lambda: c1.post(f"/allocations/{aid}/resize", json={"gpu_count": 2}, headers=if_match(v)),
            lambda: c2.post(f"/allocations/{aid}/resize", json={"gpu_count": 3}, headers=if_match(v)),
        )
        want = winner.json()["target_gpu_count"]
        done = await w.wait_status("owner", aid, "active")
        assert done["gpu_count"] == want and len(done["gpu_indices"]) == want
    state = await stored(w, aid)
    assert [t["kind"] for t in state["tasks"]] == ["provision", "resize"]
    assert len(state["gpus"]) == want
    resizing = [e for e in state["outbox"] if e["event_type"] == "allocation.resizing"]
    assert len(resizing) == 1


async def test_if_match_forms_and_retry_release(world: World) -> None:
    w = world
    await w.host_with_agent("gpu-1", "8xH100-80GB", inject_failures="release:1")
    aid = (await w.create("owner", gpu_count=1)).json()["allocation_id"]
    await w.wait_status("owner", aid, "active")
    await settled(w, aid)
    async with w.client("owner") as c:
        await assert_all_malformed_rejected(
            lambda: stored(w, aid),
            [
                (
                    "resize",
                    lambda bad: c.post(f"/allocations/{aid}/resize", json={"gpu_count": 2}, headers=if_match(bad)),
                ),
                (
                    "grant",
                    lambda bad: c.post(
                        f"/allocations/{aid}/ssh-grants",
                        json={"user_id": str(w.ids["grantee"]), "public_key": ssh_key()[1]},
                        headers=if_match(bad),
                    ),
                ),
            ],
        )

        # `*` asks for no version; a bare number and a weak tag of the current version are accepted.
        r = await c.post(f"/allocations/{aid}/restart", headers={"If-Match": "*"})
        assert r.status_code == 202, r.text
        await w.wait_status("owner", aid, "active")
        await settled(w, aid)
        v = await version(c, aid)
        r = await c.post(f"/allocations/{aid}/restart", headers=if_match(str(v)))
        assert r.status_code == 202, r.text
        await w.wait_status("owner", aid, "active")
        await settled(w, aid)

        # The release fails once (injected); retry-release takes the version the failure left.
        r = await c.post(f"/allocations/{aid}/release", headers=if_match(f'W/"{await version(c, aid)}"'))
        assert r.status_code == 202, r.text
        await w.wait_status("owner", aid, "release_failed")
        await settled(w, aid)
        current = await version(c, aid)
        r_stale = await c.post(f"/allocations/{aid}/retry-release", headers=if_match(r.headers["etag"]))
        assert_version_mismatch(r_stale, "retry")
        r = await c.post(f"/allocations/{aid}/retry-release", headers=if_match(current))
        assert r.status_code == 202 and r.json()["status"] == "releasing", r.text
        etag_version(r)
        await w.wait_status("owner", aid, "released")
