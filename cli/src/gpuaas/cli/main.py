"""The `gpuaas` command line: login, allocations (with a live timeline), capacity queues, keys, grants, volumes,
apps, cost.

Every command prints a table (rich) or, with `--json`, the API's JSON. A problem answered by the platform
is printed as `error: <detail> (<code>)` and the command exits 1; a connection failure exits 2. The
commands live in `gpuaas.cli.commands` (one module per area) and talk to the platform only through
`gpuaas.sdk`; this module assembles them.
"""

from __future__ import annotations

from typing import Annotated

import typer

from gpuaas.cli.commands import allocations, apps, auth, costs, grants, keys, queues, volumes
from gpuaas.cli.context import State

app = typer.Typer(help="GPUaaS from the command line.", no_args_is_help=True, pretty_exceptions_enable=False)
for command in (auth.login, auth.logout, auth.whoami, auth.use, costs.cost):
    app.command()(command)
app.add_typer(allocations.app, name="alloc")
app.add_typer(keys.app, name="keys")
app.add_typer(grants.app, name="grants")
app.add_typer(volumes.app, name="volumes")
app.add_typer(apps.app, name="apps")
app.add_typer(queues.app, name="queue")


@app.callback()
def _root(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Option(help="Gateway URL (else GPUAAS_URL, config, .local/stack.json)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables")] = False,
    project: Annotated[
        str | None, typer.Option(envvar="GPUAAS_PROJECT", help="Project: id, name or id prefix (else the selected one)")
    ] = None,
) -> None:
    ctx.obj = State(url_flag=url, json=as_json, project=project)


def main() -> None:
    app()
