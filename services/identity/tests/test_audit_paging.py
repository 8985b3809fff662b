"""Issue 18: the audit search pages with `?limit=&cursor=` and `Link: <...>; rel="next"` (kit.paging); the body
stays `{"items", "total"}` and `offset` still works; a cursor is stable under new records."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from urllib.parse import urljoin

import pytest
from sqlalchemy import text

from .conftest import Identity

pytestmark = pytest.mark.integration


async def _records(identity: Identity, tenant: uuid.UUID, at: list[datetime]) -> list[str]:
    ids = [uuid.uuid4() for _ in at]
    async with identity.kit.sessions() as s, s.begin():
        await s.execute(
            text(
                "INSERT INTO audit_records (event_id, occurred_at, service, actor_kind, actor_id, tenant_id, action,"
                " resource_type, resource_id, outcome) VALUES (:e, :at, 'test', 'user', 'u', :t, 'test.paging',"
                " 'thing', 'r', 'succeeded')"
            ),
            [{"e": e, "at": t, "t": tenant} for e, t in zip(ids, at, strict=True)],
        )
    return [str(e) for e in ids]


async def test_audit_pages_with_a_stable_cursor(identity: Identity) -> None:
    op = await identity.admin()
    tenant = uuid.uuid4()
    base = datetime(2026, 2, 1, tzinfo=UTC)
    # Twelve records, four of them at one instant (the seq breaks the tie).
    at = [base + timedelta(seconds=i) for i in range(8)] + [base + timedelta(seconds=3)] * 4
    ids = await _records(identity, tenant, at)
    order = sorted(range(12), key=lambda i: (at[i], i), reverse=True)
    expected = [ids[i] for i in order]
    params = {"tenant_id": str(tenant), "action": "test.paging", "limit": "5"}
    first = await identity.client.get("/audit", params=params, headers=op)
    assert first.status_code == 200, first.text
    assert first.json()["total"] == 12 and [e["event_id"] for e in first.json()["items"]] == expected[:5]
    await _records(identity, tenant, [base + timedelta(days=1)])  # newer: lands before page one
    seen = [e["event_id"] for e in first.json()["items"]]
    r = await identity.client.get(urljoin(str(first.url), first.links["next"]["url"]), headers=op)
    while True:
        assert r.status_code == 200, r.text
        seen += [e["event_id"] for e in r.json()["items"]]
        if "next" not in r.links:
            break
        r = await identity.client.get(urljoin(str(r.url), r.links["next"]["url"]), headers=op)
    assert seen == expected
    # offset keeps working for existing callers
    r = await identity.client.get("/audit", params={**params, "offset": "1"}, headers=op)
    assert r.json()["items"][0]["event_id"] == expected[0] and r.json()["total"] == 13
    bad = await identity.client.get("/audit", params={**params, "cursor": "bm90LWEtbGlzdA"}, headers=op)
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_cursor"
