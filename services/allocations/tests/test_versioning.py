"""Optimistic concurrency on allocations (ARCHITECTURE §11): GET answers the version as `ETag`; restart,
resize, release, retry-release, volume attach/detach and grant create/revoke accept `If-Match`, checked
under the allocation's row lock. A stale one is 412 `version_mismatch` and changes nothing (row, timeline,
tasks, grants, volumes, outbox); the current one succeeds and the response carries the new `ETag`."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from gpuaas.kit.testing import wait_for

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


async def etag_of(c: httpx.AsyncClient, aid: str) -> str:
    r = await c.get(f"/allocations/{aid}")
    assert r.status_code == 200, r.text
    assert r.headers["etag"] == f'"{r.json()["version"]}"'
    return str(r.headers["etag"])


def assert_412(r: httpx.Response, label: str) -> None:
    assert r.status_code == 412, (label, r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/problem+json"), label
    assert r.json()["code"] == "version_mismatch", (label, r.json())


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
        assert r.status_code == 201 and r.headers["etag"] == f'"{r.json()["version"]}"', r.text
        aid = r.json()["allocation_id"]
        await w.wait_status("owner", aid, "active")
        await settled(w, aid)

        # Attaching moves the version on (the volume ids are part of the allocation); a grant does not.
        v = await etag_of(c, aid)
        r = await c.post(f"/allocations/{aid}/volumes", json={"volume_id": data["volume_id"]}, headers={"If-Match": v})
        assert r.status_code == 201, r.text
        v_attached = await etag_of(c, aid)
        assert int(v_attached.strip('"')) == int(v.strip('"')) + 1 and r.headers["etag"] == v_attached
        r = await c.post(
            f"/allocations/{aid}/ssh-grants",
            json={"user_id": str(w.ids["grantee"]), "public_key": grantee_pub},
            headers={"If-Match": v_attached},
        )
        assert r.status_code == 201 and r.headers["etag"] == v_attached, r.text
        grant_id = r.json()["grant_id"]
        await settled(w, aid)

        # Every change sent with the version before the attachment: 412, and nothing stored moves.
        stale = {"If-Match": v}
        before = await stored(w, aid)
        for label, send in (
            ("restart", c.post(f"/allocations/{aid}/restart", headers=stale)),
            ("resize", c.post(f"/allocations/{aid}/resize", json={"gpu_count": 2}, headers=stale)),
            ("release", c.post(f"/allocations/{aid}/release", headers=stale)),
            ("retry-release", c.post(f"/allocations/{aid}/retry-release", headers=stale)),
            ("attach", c.post(f"/allocations/{aid}/volumes", json={"volume_id": scratch["volume_id"]}, headers=stale)),
            ("detach", c.delete(f"/allocations/{aid}/volumes/{data['volume_id']}", headers=stale)),
            (
                "grant",
                c.post(
                    f"/allocations/{aid}/ssh-grants",
                    json={"user_id": str(w.ids["grantee"]), "public_key": other_pub},
                    headers=stale,
                ),
            ),
            ("revoke", c.delete(f"/allocations/{aid}/ssh-grants/{grant_id}", headers=stale)),
        ):
            assert_412(await send, label)
        # A weak tag of a stale version is as stale.
        assert_412(await c.post(f"/allocations/{aid}/restart", headers={"If-Match": f"W/{v}"}), "weak restart")
        assert await stored(w, aid) == before
        assert (await etag_of(c, aid)) == v_attached

        # The current version succeeds, and each response carries the version it left behind.
        r = await c.post(f"/allocations/{aid}/restart", headers={"If-Match": v_attached})
        assert r.status_code == 202 and r.json()["status"] == "restarting", r.text
        assert r.headers["etag"] == f'"{r.json()["version"]}"' and r.json()["version"] == int(v_attached.strip('"')) + 1
        await w.wait_status("owner", aid, "active")
        await settled(w, aid)
        v = await etag_of(c, aid)
        r = await c.delete(f"/allocations/{aid}/ssh-grants/{grant_id}", headers={"If-Match": v})
        assert r.status_code == 200 and r.json()["status"] == "revoked" and r.headers["etag"] == v, r.text
        r = await c.delete(f"/allocations/{aid}/volumes/{data['volume_id']}", headers={"If-Match": v})
        assert r.status_code == 200 and r.json()["attachments"] == [], r.text
        v = await etag_of(c, aid)
        assert r.headers["etag"] == v
        r = await c.post(f"/allocations/{aid}/resize", json={"gpu_count": 2}, headers={"If-Match": v})
        assert r.status_code == 202 and r.json()["target_gpu_count"] == 2, r.text
        await w.wait_status("owner", aid, "active")
        await settled(w, aid)
        r = await c.post(f"/allocations/{aid}/release", headers={"If-Match": await etag_of(c, aid)})
        assert r.status_code == 202 and r.headers["etag"] == f'"{r.json()["version"]}"', r.text
        await w.wait_status("owner", aid, "released")


async def test_two_resizes_with_one_if_match_exactly_one_wins(world: World) -> None:
    w = world
    await w.host_with_agent("gpu-1", "8xH100-80GB")
    aid = (await w.create("owner", gpu_count=1)).json()["allocation_id"]
    await w.wait_status("owner", aid, "active")
    await settled(w, aid)
    async with w.client("owner") as c1, w.client("owner") as c2:
        v = await etag_of(c1, aid)
        r2, r3 = await asyncio.gather(
            c1.post(f"/allocations/{aid}/resize", json={"gpu_count": 2}, headers={"If-Match": v}),
            c2.post(f"/allocations/{aid}/resize", json={"gpu_count": 3}, headers={"If-Match": v}),
        )
        assert sorted([r2.status_code, r3.status_code]) == [202, 412], (r2.text, r3.text)
        winner, loser = (r2, r3) if r2.status_code == 202 else (r3, r2)
        assert_412(loser, "the second resize")
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
        before = await stored(w, aid)
        for bad in ("abc", '"0"', '"-3"', 'W/"x"'):
            r = await c.post(f"/allocations/{aid}/resize", json={"gpu_count": 2}, headers={"If-Match": bad})
            assert r.status_code == 422 and r.json()["code"] == "if_match_invalid", (bad, r.text)
            r = await c.post(
                f"/allocations/{aid}/ssh-grants",
                json={"user_id": str(w.ids["grantee"]), "public_key": ssh_key()[1]},
                headers={"If-Match": bad},
            )
            assert r.status_code == 422 and r.json()["code"] == "if_match_invalid", (bad, r.text)
        assert await stored(w, aid) == before

        # `*` asks for no version; a bare number and a weak tag of the current version are accepted.
        r = await c.post(f"/allocations/{aid}/restart", headers={"If-Match": "*"})
        assert r.status_code == 202, r.text
        await w.wait_status("owner", aid, "active")
        await settled(w, aid)
        v = (await etag_of(c, aid)).strip('"')
        r = await c.post(f"/allocations/{aid}/restart", headers={"If-Match": v})
        assert r.status_code == 202, r.text
        await w.wait_status("owner", aid, "active")
        await settled(w, aid)

        # The release fails once (injected); retry-release takes the version the failure left.
        r = await c.post(f"/allocations/{aid}/release", headers={"If-Match": f"W/{await etag_of(c, aid)}"})
        assert r.status_code == 202, r.text
        await w.wait_status("owner", aid, "release_failed")
        await settled(w, aid)
        current = await etag_of(c, aid)
        assert_412(await c.post(f"/allocations/{aid}/retry-release", headers={"If-Match": r.headers["etag"]}), "retry")
        r = await c.post(f"/allocations/{aid}/retry-release", headers={"If-Match": current})
        assert r.status_code == 202 and r.json()["status"] == "releasing", r.text
        assert r.headers["etag"] == f'"{r.json()["version"]}"'
        await w.wait_status("owner", aid, "released")
