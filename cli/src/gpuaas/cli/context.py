"""What every command shares: the global options (`State`), the signed-in client (refreshing its token once
it expires), the project a command acts in, and how failures end the process.

A problem answered by the platform is printed as `error: <detail> (<code>, HTTP <status>)`, followed by
`  <field>: <reason>` for each field a validation problem names (gpuaas.cli.problems), and exits 1; a
connection failure exits 2; a `--wait` that runs out of time exits 3. A name or short id that names nothing, or
more than one thing, is printed as `error: ... (not_found | ambiguous_reference)` and exits 1.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import typer
from rich.markup import escape

from gpuaas.cli import lookup, problems
from gpuaas.cli.config import Config, resolve_url
from gpuaas.cli.output import err
from gpuaas.cli.refs import Unresolved
from gpuaas.sdk import ApiError, Client

T = TypeVar("T")


@dataclass
class State:
    url_flag: str | None = None
    json: bool = False
    project: str | None = None
    config: Config = field(default_factory=Config.load)

    @property
    def url(self) -> str:
        return resolve_url(self.url_flag, self.config)


def state_of(ctx: typer.Context) -> State:
    return ctx.ensure_object(State)


def run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        return asyncio.run(coro)
    except ApiError as exc:
        first, *fields = problems.render(exc.status, exc.problem)
        err.print(f"[red]error:[/red] {escape(first)}", highlight=False, soft_wrap=True)
        for line in fields:
            err.print(escape(line), highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except Unresolved as exc:
        err.print(f"[red]error:[/red] {exc.detail} ({exc.code})", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except httpx.HTTPError as exc:
        err.print(f"[red]error:[/red] cannot reach the platform: {exc.__class__.__name__} {exc}", highlight=False)
        raise typer.Exit(2) from None
    except TimeoutError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(3) from None


def client(st: State, *, authenticated: bool = True) -> Client:
    """A client with the saved access token; on a 401 the refresh token buys a new one (and is saved), or the
    saved session is dropped when the platform ended it."""
    cfg = st.config
    c = Client(st.url, token=cfg.access_token if authenticated else None)

    async def refresh() -> str:
        if not cfg.refresh_token:
            raise ApiError(401, {"code": "not_signed_in", "detail": "Not signed in: run `gpuaas login`."})
        try:
            tokens = await c.token_grant("refresh_token", refresh_token=cfg.refresh_token)
        except ApiError as exc:
            cfg.access_token = cfg.refresh_token = None
            cfg.save()
            raise ApiError(exc.status, exc.problem | {"detail": "Your session ended: run `gpuaas login`."}) from None
        cfg.access_token, cfg.refresh_token = tokens.access_token, tokens.refresh_token or cfg.refresh_token
        cfg.save()
        return tokens.access_token

    c.token_provider = refresh
    return c


async def call(st: State, action: Callable[[Client], Awaitable[T]]) -> T:
    """One request (or a few) on a fresh signed-in client."""
    async with client(st) as c:
        return await action(c)


async def project_id(st: State, c: Client) -> str:
    """`--project` (an id, a name, `tenant/name` or a unique id prefix), else the selected one, else the first
    project the user is a member of."""
    if st.project:
        return await lookup.project(c, st.project)
    if st.config.project_id:
        return st.config.project_id
    me = await c.me()
    for m in me.memberships:
        if m.project_id:
            return str(m.project_id)
    raise ApiError(422, {"code": "project_required", "detail": "No project: pass --project or run `gpuaas use`."})


def new_key() -> str:
    """An Idempotency-Key: a command retried by the client is applied once."""
    return str(uuid.uuid4())
