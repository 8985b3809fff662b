"""Issue 18: placement reads host_capacity (kept exact by triggers), never every assignment; the
allocation lists page with `?limit=&cursor=` and `Link: <...>; rel="next"` (allocation 501 listable,
a cursor stable under inserts)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from urllib.parse import urljoin

import httpx
import pytest
from sqlalchemy import text

from .conftest import World
from .test_capacity_and_failures import register_without_agent

pytestmark = pytest.mark.integration

_TRUTH = """
SELECT h.host_id, g->>'model' AS model, count(*) AS total,
       count(a.gpu_index) AS used
FROM hosts h CROSS JOIN jsonb_array_elements(h.gpus) g
LEFT JOIN gpu_assignments a ON a.host_id = h.host_id AND a.gpu_index = (g->>'index')::int
GROUP BY h.host_id, g->>'model'
"""


async def _capacity_matches_truth(w: World) -> dict[tuple[uuid.UUID, str], tuple[int, int]]:
    async with w.kit.sessions() as s:
        truth = {(r.host_id, r.model): (r.total, r.used) for r in await s.execute(text(_TRUTH))}
        kept = {
            (r.host_id, r.gpu_model): (r.total, r.used)
            for r in await s.execute(text("SELECT host_id, gpu_model, total, used FROM host_capacity"))
        }
    assert kept == truth
    return kept


async def test_host_capacity_follows_every_assignment_change(world: World) -> None:
    w = world
    await register_without_agent(w, (await w.enrol("cap-a"))["node_token"], 4)
    await register_without_agent(w, (await w.enrol("cap-b"))["node_token"], 2, "A100-80GB")
    assert sorted(v for v in (await _capacity_matches_truth(w)).values()) == [(2, 0), (4, 0)]
    created = await asyncio.gather(*[w.create("owner", gpu_count=1) for _ in range(3)])
    assert [r.status_code for r in created] == [201, 201, 201]
    a100 = await w.create("owner", gpu_model="A100-80GB", gpu_count=2)
    assert a100.status_code == 201, a100.text
    assert sorted(v for v in (await _capacity_matches_truth(w)).values()) == [(2, 2), (4, 3)]
    # The A100 host is full: a third A100 is refused although H100s are free (per-model counts).
    refused = await w.create("owner", gpu_model="A100-80GB", gpu_count=1, queue=False)
    assert refused.status_code == 409 and refused.json()["code"] == "insufficient_capacity"
    # Freeing GPUs (the release path deletes assignments) is reflected in the same transaction.
    async with w.kit.sessions() as s, s.begin():
        await s.execute(
            text("DELETE FROM gpu_assignments WHERE allocation_id = :a"), {"a": a100.json()["allocation_id"]}
        )
    assert sorted(v for v in (await _capacity_matches_truth(w)).values()) == [(2, 0), (4, 3)]
    # A new inventory (the agent re-registers with more GPUs) rebuilds the host's rows, keeping `used`.
    async with w.kit.sessions() as s, s.begin():
        await s.execute(
            text(
                'UPDATE hosts SET gpus = gpus || \'[{"index": 4, "model": "H100-80GB", "memory_mb": 1}]\'::jsonb'
                " WHERE name = 'cap-a'"
            )
        )
    assert sorted(v for v in (await _capacity_matches_truth(w)).values()) == [(2, 0), (5, 3)]
    second = await w.create("owner", gpu_count=2)
    assert second.status_code == 201 and sorted(second.json()["gpu_indices"]) == [3, 4], second.text
    assert sorted(v for v in (await _capacity_matches_truth(w)).values()) == [(2, 0), (5, 5)]


async def _seed(w: World, project: str, n: int, start: datetime) -> list[str]:
    """`n` released allocations (a second apart, oldest first), straight into the table."""
    ids = [uuid.uuid4() for _ in range(n)]
    rows = [
        {
            "id": a,
            "t": w.ids["t1"],
            "p": w.ids[project],
            "at": start + timedelta(seconds=i),
            "u": "a" + a.hex[-11:],
        }
        for i, a in enumerate(ids)
    ]
    async with w.kit.sessions() as s, s.begin():
        await s.execute(
            text(
                "INSERT INTO allocations (allocation_id, tenant_id, project_id, shape, gpu_model, gpu_count,"
                " status, status_changed_at, ssh_username, requested_at)"
                " VALUES (:id, :t, :p, 'gpu_slice', 'H100-80GB', 1, 'released', :at, :u, :at)"
            ),
            rows,
        )
    return [str(a) for a in ids]


async def _all_pages(c: httpx.AsyncClient, url: str, params: dict[str, str]) -> tuple[list[str], int]:
    seen: list[str] = []
    pages = 0
    r = await c.get(url, params=params)
    while True:
        assert r.status_code == 200, r.text
        pages += 1
        seen += [a["allocation_id"] for a in r.json()]
        nxt = r.links.get("next")
        if nxt is None:
            return seen, pages
        r = await c.get(urljoin(str(r.url), nxt["url"]))


async def test_allocation_501_is_listable_and_cursor_is_stable(world: World) -> None:
    w = world
    base = datetime(2026, 1, 1, tzinfo=UTC)
    ids = await _seed(w, "p1", 501, base)
    newest_first = ids[::-1]
    url = f"/projects/{w.ids['p1']}/allocations"
    async with w.client("owner") as c:
        # Default page: the old 500, now with a next link; the 501st is on page two.
        first = await c.get(url, params={"include_released": "true"})
        assert [a["allocation_id"] for a in first.json()] == newest_first[:500]
        assert "cursor=" in first.links["next"]["url"] and "include_released=true" in first.links["next"]["url"]
        seen, pages = await _all_pages(c, url, {"include_released": "true"})
        assert seen == newest_first and pages == 2
        # Without include_released nothing shows, and no next link.
        none = await c.get(url)
        assert none.json() == [] and "next" not in none.links
        # Cursor stable under inserts: newer rows (and rows at the same instant) never shift the next page.
        page1 = await c.get(url, params={"include_released": "true", "limit": "7"})
        assert [a["allocation_id"] for a in page1.json()] == newest_first[:7]
        await _seed(w, "p1", 5, base + timedelta(days=1))
        await _seed(w, "p1", 3, base + timedelta(seconds=500 - 7))  # same requested_at as the cursor row
        page2 = await c.get(urljoin(str(page1.url), page1.links["next"]["url"]))
        got = [a["allocation_id"] for a in page2.json()]
        assert got[:7] != newest_first[:7] and not set(got) & set(newest_first[:7])
        assert [g for g in got if g in ids] == [i for i in newest_first[7:14] if i in got]
        # The cross-project list pages the same way; a bad cursor is a 400.
        everything, _ = await _all_pages(c, "/allocations", {"include_released": "true", "limit": "200"})
        assert len(everything) == len(set(everything)) == 509
        bad = await c.get(url, params={"cursor": "not-a-cursor"})
        assert bad.status_code == 400 and bad.json()["code"] == "invalid_cursor"
        too_big = await c.get(url, params={"limit": "5000"})
        assert too_big.status_code == 422
