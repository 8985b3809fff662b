"""Issue 21: recorded GPU-hours by project and GPU model (`GET /usage/gpu-hours`), the console's GPU-hours
charts: the hours are the usage records' (what billing rates), scoped to the projects the caller may read."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from gpuaas.contracts.events import allocations as allocation_events

pytestmark = pytest.mark.integration


def hour_floor(t: datetime) -> datetime:
    return t.replace(minute=0, second=0, microsecond=0)


async def test_gpu_hours_by_project_and_model(h, metering, auth) -> None:
    client, kit, w = metering
    hour = hour_floor(datetime.now(UTC)) - timedelta(hours=1)
    start = hour - timedelta(hours=3)
    # p1: 2 x H100 for 3 h and 1 x L40S for 3 h; p2 (another tenant): 4 x H100 for 3 h.
    e1, _ = h.new_allocation(w["t1"], w["p1"], start, gpus=2)
    _, s2 = h.new_allocation(w["t1"], w["p1"], start, gpus=1)
    l40s_state = s2.model_copy(update={"gpu_model": "L40S"})
    l40s = allocation_events.AllocationActivated.build(data=l40s_state, source="allocations")
    e3, _ = h.new_allocation(w["t2"], w["p2"], start, gpus=4)
    await h.apply(kit, e1, l40s, e3)
    await h.close_windows(kit, at=hour)

    since = (start - timedelta(minutes=1)).isoformat()
    r = await client.get("/usage/gpu-hours", params={"since": since}, headers=auth(w["op"]))
    assert r.status_code == 200, r.text
    rows = {(x["project_id"], x["gpu_model"]): Decimal(x["gpu_hours"]) for x in r.json()["rows"]}
    assert rows == {
        (str(w["p1"]), "H100-80GB"): Decimal(6),
        (str(w["p1"]), "L40S"): Decimal(3),
        (str(w["p2"]), "H100-80GB"): Decimal(12),
    }
    assert r.json()["rows"][0]["project_id"] == str(w["p2"])  # biggest first
    assert all(x["records"] == 3 for x in r.json()["rows"])
    # A viewer of p1 sees p1 only, asked by project or not; another tenant's admin sees their own.
    mine = await client.get("/usage/gpu-hours", params={"since": since}, headers=auth(w["viewer"]))
    assert {x["project_id"] for x in mine.json()["rows"]} == {str(w["p1"])}
    assert sum(Decimal(x["gpu_hours"]) for x in mine.json()["rows"]) == Decimal(9)
    other = await client.get("/usage/gpu-hours", params={"since": since}, headers=auth(w["other"]))
    assert {x["project_id"] for x in other.json()["rows"]} == {str(w["p2"])}
    refused = await client.get(
        "/usage/gpu-hours", params={"since": since, "project_id": str(w["p1"])}, headers=auth(w["other"])
    )
    assert refused.status_code == 404
    # The window: records whose window starts in [since, until).
    r = await client.get(
        "/usage/gpu-hours",
        params={"since": since, "until": (start + timedelta(hours=1)).isoformat(), "project_id": str(w["p1"])},
        headers=auth(w["viewer"]),
    )
    assert {x["gpu_model"]: Decimal(x["gpu_hours"]) for x in r.json()["rows"]} == {"H100-80GB": 2, "L40S": 1}
    bad = await client.get("/usage/gpu-hours", params={"since": since, "until": since}, headers=auth(w["op"]))
    assert bad.status_code == 422 and bad.json()["code"] == "invalid_range"
