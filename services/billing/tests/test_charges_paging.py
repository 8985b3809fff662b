"""Issue 18: the charge list pages with `?limit=&cursor=` and `Link: <...>; rel="next"` (kit.paging); the
body stays a JSON array; a cursor is stable under new charges."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from urllib.parse import urljoin

import pytest

pytestmark = pytest.mark.integration


async def test_charges_page_with_a_stable_cursor(h, billing, auth) -> None:
    client, kit, w = billing
    op = auth(w["op"])
    r = await client.post(
        "/prices",
        json={
            "unit": "gpu_hour",
            "unit_price": "2.50",
            "currency": "USD",
            "gpu_model": "H100-80GB",
            "shape": "gpu_slice",
            "effective_from": "2026-01-01T00:00:00+00:00",
        },
        headers=op,
    )
    assert r.status_code == 201, r.text
    base = datetime(2026, 3, 1, tzinfo=UTC)
    usage = [
        h.gpu_usage(w["t1"], w["p1"], base + timedelta(minutes=i), base + timedelta(minutes=i + 1)) for i in range(23)
    ]
    await h.apply(kit, *usage)
    admin = auth(w["padmin"])
    newest_first = [u.data.usage_record_id for u in reversed(usage)]

    first = await client.get("/charges", params={"project_id": str(w["p1"]), "limit": "10"}, headers=admin)
    assert first.status_code == 200 and isinstance(first.json(), list)
    assert [c["usage_record_id"] for c in first.json()] == [str(u) for u in newest_first[:10]]
    nxt = first.links["next"]["url"]
    assert nxt.startswith("?") and f"project_id={w['p1']}" in nxt and "limit=10" in nxt
    # A newer charge lands before page one; page two still continues exactly where page one ended.
    late = h.gpu_usage(w["t1"], w["p1"], base + timedelta(days=1), base + timedelta(days=1, minutes=1))
    await h.apply(kit, late)
    seen = [c["usage_record_id"] for c in first.json()]
    r = await client.get(urljoin(str(first.url), nxt), headers=admin)
    pages = 1
    while True:
        assert r.status_code == 200, r.text
        pages += 1
        seen += [c["usage_record_id"] for c in r.json()]
        if "next" not in r.links:
            break
        r = await client.get(urljoin(str(r.url), r.links["next"]["url"]), headers=admin)
    assert seen == [str(u) for u in newest_first] and pages == 3
    # Default page (100) holds everything, the new one first, without a next link.
    every = await client.get("/charges", params={"project_id": str(w["p1"])}, headers=admin)
    assert len(every.json()) == 24 and every.json()[0]["usage_record_id"] == str(late.data.usage_record_id)
    assert "next" not in every.links
    bad = await client.get("/charges", params={"project_id": str(w["p1"]), "cursor": "x"}, headers=admin)
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_cursor"
