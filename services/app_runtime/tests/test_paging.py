"""Issue 18: the instance list pages with `?limit=&cursor=` and `Link: <...>; rel="next"` (kit.paging), its
body still `{"items": [...]}`; the instance timeline keeps `after` and says where the next page starts."""

from __future__ import annotations

import uuid
from urllib.parse import urljoin

import httpx
import pytest
from sqlalchemy import text

from .conftest import World

pytestmark = pytest.mark.integration


async def _instances(w: World, n: int) -> list[uuid.UUID]:
    ids = [uuid.uuid4() for _ in range(n)]
    async with w.rt.kit.sessions() as s, s.begin():
        await s.execute(
            text(
                "INSERT INTO instances (instance_id, tenant_id, project_id, name, app_slug, app_version, manifest_id,"
                " artifact_digest, status, placement_intent, config, version)"
                " VALUES (:i, :t, :p, :n, :slug, '1.0', :m, 'sha256:x', 'running', '{}', '{}', 1)"
            ),
            [
                {"i": i, "t": w.tenant, "p": w.project, "n": f"i{k}", "slug": w.slug, "m": w.manifests["1.0"]}
                for k, i in enumerate(ids)
            ],
        )
    return ids


async def test_instances_page_and_timeline_links(world: World) -> None:
    w = world
    ids = await _instances(w, 7)
    token = w.rt.signer.token(w.admin)
    async with httpx.AsyncClient(base_url=w.rt.url, headers={"Authorization": f"Bearer {token}"}) as c:
        first = await c.get("/instances", params={"project_id": str(w.project), "limit": "3"})
        assert first.status_code == 200, first.text
        got = [i["instance_id"] for i in first.json()["items"]]
        expected = [str(i) for i in sorted(ids, reverse=True)]
        assert got == expected[:3]
        # Instances created meanwhile do not shift the pages that follow.
        await _instances(w, 4)
        r = await c.get(urljoin(str(first.url), first.links["next"]["url"]))
        while True:
            assert r.status_code == 200, r.text
            got += [i["instance_id"] for i in r.json()["items"] if uuid.UUID(i["instance_id"]) in ids]
            if "next" not in r.links:
                break
            r = await c.get(urljoin(str(r.url), r.links["next"]["url"]))
        assert got == expected
        everything = await c.get("/instances", params={"project_id": str(w.project)})
        assert len(everything.json()["items"]) == 11 and "next" not in everything.links
        bad = await c.get("/instances", params={"cursor": "%%%"})
        assert bad.status_code == 400 and bad.json()["code"] == "invalid_cursor"

        target = ids[0]
        async with w.rt.kit.sessions() as s, s.begin():
            await s.execute(
                text("INSERT INTO instance_events (instance_id, kind, message) VALUES (:i, 'note', :m)"),
                [{"i": target, "m": f"e{k}"} for k in range(5)],
            )
        page = await c.get(f"/instances/{target}/events", params={"limit": "2"})
        assert [e["message"] for e in page.json()["items"]] == ["e0", "e1"]
        seen = [e["message"] for e in page.json()["items"]]
        while "next" in page.links:
            assert "after=" in page.links["next"]["url"]
            page = await c.get(urljoin(str(page.url), page.links["next"]["url"]))
            seen += [e["message"] for e in page.json()["items"]]
        assert seen == ["e0", "e1", "e2", "e3", "e4"]
