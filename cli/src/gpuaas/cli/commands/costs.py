"""`gpuaas cost`: combined cost (GPU time + app usage) of a period, per project, or with `--by day` the
daily series of the period (and the budgets of the scope). Amounts always carry their currency."""

from __future__ import annotations

from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any

import typer

from gpuaas.cli import lookup
from gpuaas.cli.context import client, project_id, run, state_of
from gpuaas.cli.output import emit, money, out, table, text
from gpuaas.cli.refs import short_ids
from gpuaas.sdk.models import Costs


class By(StrEnum):
    project = "project"
    day = "day"


def cost(
    ctx: typer.Context,
    period: Annotated[str | None, typer.Option(help="YYYY-MM (default: the current period)")] = None,
    tenant: Annotated[
        str | None, typer.Option(help="Tenant (id, name, slug or id prefix): the whole tenant (tenant admins)")
    ] = None,
    by: Annotated[
        By, typer.Option(help="project: the period per project; day: spend per day of the period")
    ] = By.project,
) -> None:
    """Combined cost (GPU time + app usage) of the current period, per project (or per day with --by day)."""
    st = state_of(ctx)

    async def scope(c: Any) -> dict[str, str]:
        if tenant:
            return {"tenant_id": await lookup.tenant(c, tenant)}
        return {"project_id": await project_id(st, c)}

    if by == By.day:

        async def daily() -> tuple[dict[str, Any], dict[str, str]]:
            async with client(st) as c:
                data = await c.daily_costs(period=period, **await scope(c))
                names = {p["project_id"]: p["name"] for p in await lookup.my_projects(c)}
                return data, names

        data, names = run(daily())
        emit(st, data, lambda d: render_daily(d, names))
        return

    async def go() -> tuple[Costs, dict[str, str]]:
        async with client(st) as c:
            s = await scope(c)
            costs = await c.costs(period=period, **s)
            names = {p["project_id"]: p["name"] for p in await lookup.my_projects(c)}
            return costs, names

    costs, names = run(go())

    def render(data: Costs) -> None:
        totals = " + ".join(money(t.amount, t.currency) for t in data.totals) or "nothing charged yet"
        out.print(f"Period {text(data.period_start)} to {text(data.period_end)}: [bold]{totals}[/bold]")
        shorts = short_ids(p.project_id for p in data.projects)
        out.print(
            table(
                "Per project",
                ["project", "GPU time", "app usage", "total"],
                [
                    [
                        names.get(str(p.project_id)) or shorts[str(p.project_id)],
                        money(p.gpu_amount, p.currency),
                        money(p.app_amount, p.currency),
                        money(p.amount, p.currency),
                    ]
                    for p in data.projects
                ],
            )
        )

    emit(st, costs, render)


def render_daily(d: dict[str, Any], names: dict[str, str]) -> None:
    """One row per day with charges: GPU time, app usage, the day's total and the period's running total."""
    scope = names.get(str(d.get("project_id"))) if d.get("project_id") else "the whole tenant"
    out.print(f"Spend per day, {text(d['period_start'])[:10]} to {text(d['period_end'])[:10]} ({scope})")
    running: dict[str, Decimal] = {}
    rows: list[list[str]] = []
    for day in d["days"]:
        cur = day["currency"]
        running[cur] = running.get(cur, Decimal(0)) + Decimal(str(day["amount"]))
        rows.append(
            [
                day["day"],
                money(day["gpu_amount"], cur),
                money(day["app_amount"], cur),
                money(day["amount"], cur),
                money(running[cur], cur),
            ]
        )
    out.print(table("Daily spend", ["day", "GPU time", "app usage", "total", "period so far"], rows))
    totals = " + ".join(money(v, c) for c, v in running.items()) or "nothing charged yet"
    out.print(f"Period total: [bold]{totals}[/bold]")
    for b in d.get("budgets", []):
        spent = running.get(b["currency"], Decimal(0))
        limit = Decimal(str(b["limit_amount"]))
        share = f"{spent / limit * 100:.0f}%" if limit else "-"
        used = f"{money(spent, b['currency'])} of {money(limit, b['currency'])} ({share})"
        out.print(f"Budget {b['name'] or '(unnamed)'}: {used}")
