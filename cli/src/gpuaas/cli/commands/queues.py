"""`gpuaas queue show`: capacity queues per pool (GPU model): usage against guarantee, limit and weight,
borrowed, lent and the waiting requests by reason. Operators see every queue; anyone else sees their
project's queue of `--model`."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from gpuaas.cli.context import client, project_id, run, state_of
from gpuaas.cli.output import emit, out, table
from gpuaas.sdk.models import CapacityQueue
from gpuaas.sdk.transport import ApiError

app = typer.Typer(help="Capacity queues: who waits for which GPUs, and each queue's share.", no_args_is_help=True)


def queue_rows(qs: list[CapacityQueue]) -> Table:
    return table(
        "Capacity queues",
        ["pool", "queue", "guarantee", "limit", "weight", "in use", "borrowed", "lent", "waiting", "reasons"],
        [
            [
                q.gpu_model,
                f"{q.scope} {str(q.scope_id)[:8]}" + ("" if q.queue_id else " (defaults)"),
                q.guarantee,
                "-" if q.limit is None else q.limit,
                f"{q.weight:g}",
                q.in_use,
                q.borrowed,
                q.lent,
                f"{q.waiting} ({q.waiting_gpus} GPUs)" if q.waiting else "0",
                ", ".join(f"{r}: {n}" for r, n in sorted(q.pending_reasons.items())),
            ]
            for q in qs
        ],
    )


@app.command("show")
def show(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(help="Only this pool (GPU model)")] = None,
) -> None:
    """Every queue (operators), else the current project's queue of --model (default H100-80GB)."""
    st = state_of(ctx)

    async def go() -> list[CapacityQueue]:
        async with client(st) as c:
            try:
                return await c.queues(model)
            except ApiError as exc:
                if exc.status != 403:
                    raise
            return [await c.project_queue(await project_id(st, c), model or "H100-80GB")]

    emit(st, run(go()), lambda qs: out.print(queue_rows(qs)))
