"""`gpuaas grants`: another project member's SSH key on one of your allocations. The allocation is an id, a
name or a short id; the member an email, a display name, a user id or its prefix; a grant its short id or
the key's fingerprint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gpuaas.cli import lookup
from gpuaas.cli.commands.allocations import Ref, allocation_ref
from gpuaas.cli.context import client, new_key, project_id, run, state_of
from gpuaas.cli.output import emit, out, table
from gpuaas.cli.refs import is_uuid, short_ids
from gpuaas.sdk.models import SshGrant

app = typer.Typer(help="SSH grants: another project member's key on one allocation.", no_args_is_help=True)
Member = Annotated[str, typer.Argument(metavar="MEMBER", help="Email, name, user id or a unique id prefix")]
Grant = Annotated[str, typer.Argument(metavar="GRANT", help="Grant id, its short id or the key's fingerprint")]


@app.command("list")
def list_(ctx: typer.Context, allocation: Ref) -> None:
    st = state_of(ctx)

    async def go() -> tuple[list[SshGrant], dict[str, str | None]]:
        async with client(st) as c:
            pid = await project_id(st, c)
            aid = await allocation_ref(st, c, allocation)
            grants = await c.ssh_grants(aid)
            members = {str(m.user_id): m.email for m in await c.project_members(pid)}
            return grants, members

    grants, members = run(go())
    shorts = short_ids(g.grant_id for g in grants)
    emit(
        st,
        grants,
        lambda gs: out.print(
            table(
                "SSH grants",
                ["id", "user", "fingerprint", "status"],
                [
                    [shorts[str(g.grant_id)], members.get(str(g.user_id)) or g.user_id, g.fingerprint, g.status]
                    for g in gs
                ],
            )
        ),
    )


@app.command("add")
def add(ctx: typer.Context, allocation: Ref, member: Member, public_key_file: Path) -> None:
    st = state_of(ctx)
    public_key = public_key_file.read_text().strip()

    async def go() -> SshGrant:
        async with client(st) as c:
            aid = await allocation_ref(st, c, allocation)
            uid = member if is_uuid(member) else await lookup.user(c, await project_id(st, c), member)
            return await c.grant_ssh(aid, uid, public_key, idempotency_key=new_key())

    emit(st, run(go()), lambda g: out.print(f"Granted {member} ({g.fingerprint}): {g.status}"))


@app.command("remove")
@app.command("revoke", hidden=True)
def remove(ctx: typer.Context, allocation: Ref, grant: Grant) -> None:
    """Revoke a grant: the key is removed from the allocation."""
    st = state_of(ctx)

    async def go() -> SshGrant:
        async with client(st) as c:
            aid = await allocation_ref(st, c, allocation)
            return await c.revoke_ssh_grant(aid, await lookup.grant(c, aid, grant))

    emit(st, run(go()), lambda g: out.print(f"Revoked {g.fingerprint}: {g.status}"))
