"""`gpuaas cost`: combined cost (GPU time + app usage) of a period, per project."""

from __future__ import annotations

from typing import Annotated

import typer

from gpuaas.cli.context import client, project_id, run, state_of
from gpuaas.cli.output import emit, out, table, text
from gpuaas.sdk.models import Costs


def cost(
    ctx: typer.Context,
    period: Annotated[str | None, typer.Option(help="YYYY-MM (default: the current period)")] = None,
    tenant: Annotated[str | None, typer.Option(help="Tenant id: the whole tenant (tenant admins)")] = None,
) -> None:
    """Combined cost (GPU time + app usage) of the current period, per project."""
    st = state_of(ctx)

    async def go() -> Costs:
        async with client(st) as c:
            if tenant:
                return await c.costs(tenant_id=tenant, period=period)
            return await c.costs(project_id=await project_id(st, c), period=period)

    def render(data: Costs) -> None:
        totals = " + ".join(f"{t.amount} {t.currency}" for t in data.totals) or "0"
        out.print(f"Period {text(data.period_start)} to {text(data.period_end)}: [bold]{totals}[/bold]")
        out.print(
            table(
                "Per project",
                ["project", "GPU time", "app usage", "total"],
                [
                    [
                        p.project_id,
                        f"{p.gpu_amount} {p.currency}",
                        f"{p.app_amount} {p.currency}",
                        f"{p.amount} {p.currency}",
                    ]
                    for p in data.projects
                ],
            )
        )

    emit(st, run(go()), render)
