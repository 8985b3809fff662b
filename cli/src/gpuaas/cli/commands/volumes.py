"""`gpuaas volumes`: the project's volumes (list, create, delete); a VOLUME is an id, a name or a short id."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from gpuaas.cli import lookup
from gpuaas.cli.context import client, project_id, run, state_of
from gpuaas.cli.output import emit, out, table
from gpuaas.cli.refs import short_ids
from gpuaas.sdk.models import Volume

app = typer.Typer(help="Project volumes.", no_args_is_help=True)


def volume_rows(vs: list[Volume]) -> Table:
    shorts = short_ids(v.volume_id for v in vs)
    return table(
        "Volumes",
        ["id", "name", "size", "mode", "status", "after release"],
        [[shorts[str(v.volume_id)], v.name, f"{v.size_gb} GB", v.access_mode, v.status, v.after_release] for v in vs],
    )


@app.command("list")
def list_(ctx: typer.Context) -> None:
    st = state_of(ctx)

    async def go() -> list[Volume]:
        async with client(st) as c:
            return await c.volumes(await project_id(st, c))

    emit(st, run(go()), lambda vs: out.print(volume_rows(vs)))


@app.command("create")
def create(
    ctx: typer.Context,
    name: str,
    size_gb: Annotated[int, typer.Option("--size", help="Size in GB")] = 100,
    persist: Annotated[bool, typer.Option(help="Keep the data after release")] = True,
    mode: Annotated[str, typer.Option(help="single_writer or multi_attach")] = "single_writer",
) -> None:
    st = state_of(ctx)

    async def go() -> Volume:
        async with client(st) as c:
            pid = await project_id(st, c)
            return await c.create_volume(pid, name=name, size_gb=size_gb, persist=persist, access_mode=mode)

    emit(st, run(go()), lambda v: out.print(volume_rows([v])))


@app.command("delete")
def delete(
    ctx: typer.Context, volume: Annotated[str, typer.Argument(metavar="VOLUME", help="Id, name or unique id prefix")]
) -> None:
    st = state_of(ctx)

    async def go() -> str:
        async with client(st) as c:
            volume_id = await lookup.volume(c, await project_id(st, c), volume)
            await c.delete_volume(volume_id)
            return volume_id

    volume_id = run(go())
    emit(st, {"deleted": volume_id}, lambda _: out.print(f"Deleted {volume} ({volume_id})."))
