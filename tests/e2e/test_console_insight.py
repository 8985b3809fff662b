"""Issue 21: the console's charts with the data of a real metered run, in a real headless Chromium.

A tenant (its admin `ada`, a member `bob`) runs allocations on two hosts of one class (two GPU models, two
projects), releases two of them (metering records their GPU time, billing rates it) and keeps one
running; a budget is set. The browser (web/console/tests/insight.e2e.mjs) then reads, as the tenant admin,
the spend-per-day chart, the GPU-hours charts by project and by GPU model, and a released allocation's
cost-so-far chart, checks the SSH member picker lists the member by email and that the tenant sees no
operator menu, and the queue page (issue 29: each queue's GPUs in use now and its share over time, per GPU model);
as the operator, the capacity chart of the host class and the occupancy grid. Every chart
is screenshotted, and the numbers each chart draws are compared here with the billing, metering and
allocations APIs."""

from __future__ import annotations

import os
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuaas.devstack.golden_path.actors import start_agent
from gpuaas.devstack.infra import stop_process
from gpuaas.devstack.pytest_plugin import new_team, target_of
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually

from .test_console import console_served, run_browser

pytestmark = pytest.mark.e2e
PASSWORD = "insight-horse-battery"
MODELS = ("L40S-48GB", "A100-80GB")
Q = Decimal("0.000001")


def dec(v: Any) -> Decimal:
    return Decimal(str(v)).quantize(Q)


async def test_charts_show_the_metered_run(stack: Stack, gw: httpx.AsyncClient, tmp_path: Path) -> None:
    await console_served(stack, gw)
    team = await new_team(gw, "ins", "Insight", "alpha", "ada", "bob", PASSWORD)
    run, tid, pid = team.run, team.tenant_id, team.project_id
    for model in MODELS:
        r = await gw.post(
            "/api/billing/prices",
            json={"unit": "gpu_hour", "unit_price": "360.00", "currency": "USD", "gpu_model": model}
            | {"shape": "gpu_slice", "effective_from": "2020-01-01T00:00:00Z"},
        )
        assert r.status_code in (201, 409), r.text
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        r = await c.post(
            "/api/identity/auth/token",
            data={"grant_type": "password", "username": team.admin_email, "password": PASSWORD},
        )
        assert r.status_code == 200, r.text
        ada = {"Authorization": f"Bearer {r.json()['access_token']}"}
        ada_id = (await c.get("/api/identity/me", headers=ada)).json()["user_id"]
    # ada administers the tenant (its budgets and every project's costs) and a second project
    r = await gw.post(f"/api/identity/tenants/{tid}/members", json={"user_id": ada_id, "role": "tenant_admin"})
    assert r.status_code == 201, r.text
    r = await gw.post(f"/api/identity/tenants/{tid}/projects", json={"name": "beta"})
    assert r.status_code == 201, r.text
    pid2 = r.json()["project_id"]
    r = await gw.post(f"/api/identity/projects/{pid2}/members", json={"user_id": ada_id, "role": "project_admin"})
    assert r.status_code == 201, r.text
    r = await gw.post(
        "/api/billing/budgets", json={"tenant_id": tid, "name": "monthly", "limit_amount": "500"} | {"currency": "USD"}
    )
    assert r.status_code == 201, r.text

    host_class = f"ins-{run}"
    agents, hosts = [], []
    live = None
    try:
        for i, model in enumerate(MODELS):
            r = await gw.post("/api/allocations/hosts", json={"name": f"{host_class}-{i}", "host_class": host_class})
            assert r.status_code == 201, r.text
            hosts.append(r.json())
            agents.append(start_agent(target_of(stack), r.json()["node_token"], f"{host_class}-{i}", f"2x{model}"))

        async def ready() -> bool:
            states = [(await gw.get(f"/api/allocations/hosts/{h['host_id']}")).json().get("status") for h in hosts]
            return states == ["ready", "ready"]

        await eventually(ready, 90, "hosts ready")
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:

            async def create(project: str, name: str, model: str, gpus: int) -> str:
                async def created() -> str | None:  # the projections catch up with identity
                    r = await c.post(
                        f"/api/allocations/projects/{project}/allocations",
                        json={"name": name, "gpu_model": model, "gpu_count": gpus, "host_class": host_class},
                        headers=ada,
                    )
                    return r.json()["allocation_id"] if r.status_code == 201 else None

                return str(await eventually(created, 60, f"create {name}", interval_s=1))

            async def status(aid: str, want: str) -> bool:
                return (await c.get(f"/api/allocations/allocations/{aid}", headers=ada)).json()["status"] == want

            a1 = await create(pid, "train", MODELS[0], 2)
            a2 = await create(pid2, "tune", MODELS[1], 1)
            for aid in (a1, a2):
                await eventually(lambda aid=aid: status(aid, "active"), 180, f"{aid} active", interval_s=1)
            live = await create(pid, "serve", MODELS[1], 1)  # stays running: the occupancy shows it
            await eventually(lambda: status(live, "active"), 180, "serve active", interval_s=1)
            for aid in (a1, a2):
                r = await c.post(f"/api/allocations/allocations/{aid}/release", headers=ada)
                assert r.status_code in (200, 202), r.text
            for aid in (a1, a2):
                await eventually(lambda aid=aid: status(aid, "released"), 180, f"{aid} released", interval_s=1)

            async def charged() -> bool:
                for project, aid in ((pid, a1), (pid2, a2)):
                    r = await c.get("/api/billing/charges", params={"project_id": project, "allocation_id": aid})
                    if not (r.status_code == 200 and r.json()):
                        return False
                r = await c.get("/api/metering/usage/gpu-hours", headers=ada)
                return {row["project_id"] for row in r.json()["rows"]} >= {pid, pid2}

            c.headers.update(ada)
            await eventually(charged, 180, "the usage metered and charged", interval_s=2)

        # kept under the stack's root (removed with it), or where GPUAAS_INSIGHT_SCREENSHOTS says
        shots = Path(os.environ.get("GPUAAS_INSIGHT_SCREENSHOTS") or stack.root / "console-insight-screenshots")
        admin_email, admin_password = stack.admin_login
        result = await run_browser(
            "insight.e2e.mjs",
            {
                "GATEWAY_URL": stack.gateway_url,
                "USER_EMAIL": team.admin_email,
                "USER_PASSWORD": PASSWORD,
                "ADMIN_EMAIL": admin_email,
                "ADMIN_PASSWORD": admin_password,
                "ALLOCATION": a1,
                "HOST_CLASS": host_class,
                "MEMBER_EMAIL": f"bob-{run}@ins-{run}.example.com",
                "SCREENSHOT_DIR": str(shots),
            },
        )
        charts = result["charts"]
        for name, chart in charts.items():
            assert Path(chart["screenshot"]).stat().st_size > 3000, name
        assert result["operatorNav"] == 0

        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30, headers=ada) as c:
            costs = (await c.get("/api/billing/costs", params={"tenant_id": tid})).json()
            daily = (await c.get("/api/billing/costs/daily", params={"tenant_id": tid})).json()
            hours = (await c.get("/api/metering/usage/gpu-hours")).json()["rows"]
            charges = (await c.get("/api/billing/charges", params={"project_id": pid, "allocation_id": a1})).json()
        # Spend per day: the bars are /costs/daily's days, they add up to /costs, the budget line is the budget.
        spend = charts["chart-spend-daily"]
        per_day = spend["values"]["series"]["This period, per day"]
        total = dec(costs["totals"][0]["amount"])
        assert total > 0 and dec(spend["total"]) == total
        assert sum(dec(v) for v in per_day if v is not None) == total
        for d in daily["days"]:
            assert dec(per_day[int(d["day"][8:10]) - 1]) == dec(d["amount"]), d
        assert spend["currency"] == "USD" and "USD" in result["costText"]
        budget_line = spend["values"]["series"]["Budget monthly"]
        assert {dec(v) for v in budget_line} == {dec(500)}
        assert len(spend["values"]["series"]["Previous period, so far"]) == len(spend["values"]["labels"])
        # GPU-hours: per project (by name) and per GPU model, as metering has them.
        by_project: dict[str, Decimal] = {}
        by_model: dict[str, Decimal] = {}
        names = {pid: "alpha", pid2: "beta"}
        for row in hours:
            by_project[names[row["project_id"]]] = by_project.get(names[row["project_id"]], Decimal(0)) + dec(
                row["gpu_hours"]
            )
            by_model[row["gpu_model"]] = by_model.get(row["gpu_model"], Decimal(0)) + dec(row["gpu_hours"])
        for chart_id, expected in (("chart-gpu-hours-project", by_project), ("chart-gpu-hours-model", by_model)):
            v = charts[chart_id]["values"]
            shown = {label: dec(x) for label, x in zip(v["labels"], v["series"]["GPU-hours"], strict=True)}
            assert shown == expected and all(x > 0 for x in shown.values()), (chart_id, shown, expected)
        assert set(by_model) == set(MODELS)
        # The allocation's cost so far: its charges, cumulative.
        cost = charts["chart-allocation-cost"]
        charged_total = sum(dec(ch["amount"]) for ch in charges)
        assert dec(cost["total"]) == charged_total == dec(result["allocCost"]["total"]) > 0
        assert dec(cost["values"]["series"]["Cost so far"][-1]) == charged_total
        assert "USD" in result["allocCost"]["text"]
        # Queues (issue 29): the tenant's and its projects' usage now, and each project's share over the window the
        # page drew (asked again with the same window: the same numbers; `serve` still runs, nothing else changed).
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30, headers=ada) as c:
            views = (await c.get(f"/api/allocations/tenants/{tid}/queues")).json()
            wanted = {(q["gpu_model"], q["scope"], q["scope_id"]): q["in_use"] for q in views}
            shown_rows = {(q["gpu_model"], q["scope"], q["scope_id"]): q["in_use"] for q in result["queueRows"]}
            assert shown_rows == wanted and wanted[(MODELS[1], "project", pid)] == 1, (shown_rows, wanted)
            assert {chart_id.removeprefix("chart-queue-share-") for chart_id in result["queueCharts"]} == {
                m.replace(".", "_") for m in MODELS
            }
            for chart_id in result["queueCharts"]:
                drawn = charts[chart_id]
                r = await c.get(
                    f"/api/allocations/tenants/{tid}/queue-history",
                    params={"since": drawn["since"], "until": drawn["until"], "points": len(drawn["values"]["labels"])}
                    | {"gpu_model": drawn["gpuModel"]},
                )
                assert r.status_code == 200, r.text
                expected = {
                    names[q["scope_id"]]: [p["mean"] for p in q["points"]]
                    for q in r.json()["queues"]
                    if q["scope"] == "project"
                }
                assert drawn["values"]["series"] == expected, (chart_id, drawn["values"]["series"], expected)
                held_by = {name for name, values in expected.items() if any(v > 0 for v in values)}
                assert held_by == ({"alpha"} if drawn["gpuModel"] == MODELS[0] else {"alpha", "beta"}), held_by
        # Capacity: the host class's used GPUs now and over time, and the occupancy grid, as allocations has them.
        r = await gw.get("/api/allocations/capacity")
        cap = next(k for k in r.json()["classes"] if k["host_class"] == host_class)
        shown_cap = charts[result["capacityChart"]]
        assert int(shown_cap["usedNow"]) == cap["used_gpus"] == 1 and int(shown_cap["totalNow"]) == 4
        used_series = shown_cap["values"]["series"]["Used"]
        assert used_series[-1] == 1 and max(used_series) >= 1
        peak_series = shown_cap["values"]["series"]["Peak used"]
        assert all(p >= u for p, u in zip(peak_series, used_series, strict=True)) and peak_series[-1] >= 1
        occupied = {
            (row["host"], g["index"]): g["allocation"]
            for row in result["occupancy"]
            if row["host"].startswith(host_class)
            for g in row["gpus"]
            if g["allocation"]
        }
        live_row = (await gw.get(f"/api/allocations/allocations/{live}")).json()
        host_name = next(h["name"] for h in hosts if h["host_id"] == live_row["host_id"])
        assert occupied == {(host_name, i): live for i in live_row["gpu_indices"]}
        assert uuid.UUID(live)
    finally:
        if live:
            await gw.post(f"/api/allocations/allocations/{live}/release")
        for agent in agents:
            stop_process(agent)
