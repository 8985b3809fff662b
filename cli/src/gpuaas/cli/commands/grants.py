"""`gpuaas grants`: another project member's SSH key on one of your allocations."""

from __future__ import annotations

from pathlib import Path

import typer

from gpuaas.cli.context import call, new_key, run, state_of
from gpuaas.cli.output import emit, out, table

app = typer.Typer(help="SSH grants: another project member's key on one allocation.", no_args_is_help=True)


@app.command("list")
def list_(ctx: typer.Context, allocation_id: str) -> None:
    st = state_of(ctx)
    emit(
        st,
        run(call(st, lambda c: c.ssh_grants(allocation_id))),
        lambda gs: out.print(
            table(
                "SSH grants",
                ["id", "user", "fingerprint", "status"],
                [[g.grant_id, g.user_id, g.fingerprint, g.status] for g in gs],
            )
        ),
    )


@app.command("add")
def add(ctx: typer.Context, allocation_id: str, user_id: str, public_key_file: Path) -> None:
    st = state_of(ctx)
    public_key = public_key_file.read_text().strip()
    g = run(call(st, lambda c: c.grant_ssh(allocation_id, user_id, public_key, idempotency_key=new_key())))
    emit(st, g, lambda g: out.print(f"Granted {g.user_id} ({g.fingerprint}): {g.status}"))


@app.command("remove")
@app.command("revoke", hidden=True)
def remove(ctx: typer.Context, allocation_id: str, grant_id: str) -> None:
    """Revoke a grant: the key is removed from the allocation."""
    st = state_of(ctx)
    g = run(call(st, lambda c: c.revoke_ssh_grant(allocation_id, grant_id)))
    emit(st, g, lambda g: out.print(f"Revoked {g.fingerprint}: {g.status}"))
