"""`gpuaas keys`: your personal SSH keys (list, add, delete)."""

from __future__ import annotations

from pathlib import Path

import typer

from gpuaas.cli.context import call, new_key, run, state_of
from gpuaas.cli.output import emit, out, table

app = typer.Typer(help="Your personal SSH keys.", no_args_is_help=True)


@app.command("list")
def list_(ctx: typer.Context) -> None:
    st = state_of(ctx)
    emit(
        st,
        run(call(st, lambda c: c.ssh_keys())),
        lambda ks: out.print(
            table("SSH keys", ["id", "name", "fingerprint"], [[k.key_id, k.name, k.fingerprint] for k in ks])
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
def delete(ctx: typer.Context, key_id: str) -> None:
    st = state_of(ctx)
    run(call(st, lambda c: c.delete_ssh_key(key_id)))
    emit(st, {"deleted": key_id}, lambda _: out.print("Deleted."))
