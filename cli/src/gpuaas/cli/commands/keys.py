"""`gpuaas keys`: your personal SSH keys (list, add, delete); a KEY is an id, a name, a fingerprint or a short id."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpuaas.cli import lookup
from gpuaas.cli.context import call, client, new_key, run, state_of
from gpuaas.cli.output import emit, out, table
from gpuaas.cli.refs import short_ids

app = typer.Typer(help="Your personal SSH keys.", no_args_is_help=True)


@app.command("list")
def list_(ctx: typer.Context) -> None:
    st = state_of(ctx)
    emit(
        st,
        run(call(st, lambda c: c.ssh_keys())),
        lambda ks: out.print(
            table(
                "SSH keys",
                ["id", "name", "fingerprint"],
                [[short_ids(k.key_id for k in ks)[str(k.key_id)], k.name, k.fingerprint] for k in ks],
            )
        ),
    )


@app.command("add")
def add(ctx: typer.Context, name: str, public_key_file: Path) -> None:
    st = state_of(ctx)
    public_key = public_key_file.read_text().strip()
    emit(
        st,
        run(call(st, lambda c: c.add_ssh_key(name, public_key, idempotency_key=new_key()))),
        lambda k: out.print(f"Added {k.name} {k.fingerprint}"),
    )


@app.command("delete")
def delete(
    ctx: typer.Context, key: Annotated[str, typer.Argument(metavar="KEY", help="Id, name, fingerprint or id prefix")]
) -> None:
    st = state_of(ctx)

    async def go() -> str:
        async with client(st) as c:
            key_id = await lookup.ssh_key(c, key)
            await c.delete_ssh_key(key_id)
            return key_id

    key_id = run(go())
    emit(st, {"deleted": key_id}, lambda _: out.print(f"Deleted {key} ({key_id})."))
