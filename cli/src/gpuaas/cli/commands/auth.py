"""Signing in and out, who is signed in, and the selected project: `login`, `logout`, `whoami`, `use`."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer

from gpuaas.cli import lookup
from gpuaas.cli import sso as sso_flow
from gpuaas.cli.context import State, call, client, run, state_of
from gpuaas.cli.output import emit, err, out, plain, table
from gpuaas.sdk import ApiError, Client
from gpuaas.sdk.models import Discovery, Project, TokenResponse


def login(
    ctx: typer.Context,
    email: Annotated[str | None, typer.Option(help="Your email")] = None,
    password: Annotated[str | None, typer.Option(envvar="GPUAAS_PASSWORD", help="Else prompted")] = None,
    sso: Annotated[bool, typer.Option(help="Single sign-on: discover your organisation's IdP and open it")] = False,
    browser: Annotated[bool, typer.Option(help="Open the sign-in page in a browser (--sso)")] = True,
    timeout: Annotated[float, typer.Option(help="Seconds --sso waits for the browser sign-in")] = 300,
) -> None:
    """Sign in (password, or --sso for a work account with single sign-on in the browser)."""
    st = state_of(ctx)
    address: str = email or typer.prompt("Email")

    async def go() -> dict[str, Any]:
        async with client(st, authenticated=False) as c:
            found = await c.discover(address)
            idp = found.identity_provider or {}
            if sso or idp.get("enforce_sso"):
                if not idp:
                    raise ApiError(
                        422,
                        {
                            "code": "sso_not_configured",
                            "detail": "no single sign-on is set up for this email's domain: use your password",
                        },
                    )
                return await _sso_login(st, c, found, address, open_browser=browser, timeout_s=timeout)
            pw = password or typer.prompt("Password", hide_input=True)
            tokens = await c.token_grant("password", username=address, password=pw)
            return await _signed_in(st, c, address, tokens)

    result = run(go())
    emit(st, result, lambda r: out.print(f"Signed in as [bold]{r['signed_in']}[/bold] on {r['url']}"))


async def _sso_login(
    st: State, c: Client, found: Discovery, email: str, *, open_browser: bool, timeout_s: float
) -> dict[str, Any]:
    """The browser flow: a loopback listener receives the single-use login code, exchanged here with the
    PKCE verifier whose challenge the start carried."""
    idp = found.identity_provider or {}
    with sso_flow.LoopbackListener() as listener:
        url = sso_flow.start_url(
            idp["sso_start_url"], email=email, return_to=listener.redirect_uri, code_verifier=listener.code_verifier
        )
        err.print(f"Work account: sign in with {idp.get('name') or 'your identity provider'} in your browser:")
        err.print(f"  {url}", highlight=False, soft_wrap=True)
        err.print("Waiting for the sign-in to finish…")
        if open_browser:
            import webbrowser

            webbrowser.open(url)
        back = await asyncio.to_thread(listener.wait, timeout_s)
    if back.get("error"):
        raise ApiError(401, {"code": back["error"], "detail": back.get("error_description") or "sign-in refused"})
    tokens = await c.token_grant(
        "sso_login_code", code=back.get("login_code", ""), code_verifier=listener.code_verifier
    )
    return {**await _signed_in(st, c, email, tokens), "method": "sso", "link_method": tokens.link_method}


async def _signed_in(st: State, c: Client, email: str, tokens: TokenResponse) -> dict[str, Any]:
    """Keep the session (config file, 0600) and select the first project when none is selected (another
    user's selection is dropped)."""
    if st.config.email and st.config.email.lower() != email.lower():
        st.config.project_id = None
    st.config.url, st.config.email = st.url, email
    st.config.access_token, st.config.refresh_token = tokens.access_token, tokens.refresh_token
    st.config.save()
    c.token = tokens.access_token
    me = await c.me()
    if not st.config.project_id:
        st.config.project_id = next((str(m.project_id) for m in me.memberships if m.project_id), None)
        st.config.save()
    return {"signed_in": me.email, "user_id": str(me.user_id), "project_id": st.config.project_id, "url": st.url}


def logout(ctx: typer.Context) -> None:
    """Revoke this session and forget the tokens."""
    st = state_of(ctx)

    async def go() -> None:
        if st.config.access_token:
            async with client(st) as c:
                try:
                    await c.logout(st.config.refresh_token or "")
                except ApiError:
                    pass

    run(go())
    st.config.access_token = st.config.refresh_token = None
    st.config.save()
    emit(st, {"signed_out": True}, lambda _: out.print("Signed out."))


def whoami(ctx: typer.Context) -> None:
    """Who is signed in: their memberships with tenant and project names, and the selected project."""
    st = state_of(ctx)

    async def go(c: Client) -> dict[str, Any]:
        me = plain(await c.me())
        tenants = {str(t["tenant_id"]): t["name"] for t in await c.tenants()}
        projects = {str(p["project_id"]): p for p in await lookup.my_projects(c)}
        for m in me["memberships"]:
            m["tenant_name"] = tenants.get(str(m["tenant_id"])) if m["tenant_id"] else None
            m["project_name"] = projects.get(str(m["project_id"]), {}).get("name") if m["project_id"] else None
        me["selected_project_id"] = st.config.project_id
        return dict(me)

    def render(me: dict[str, Any]) -> None:
        selected = me["selected_project_id"]
        out.print(
            table(
                f"{me['email']} ({me['display_name'] or 'no display name'})",
                ["scope", "role", "tenant", "project", "selected"],
                [
                    [
                        m["scope"],
                        m["role"],
                        m["tenant_name"] or ("the platform" if m["scope"] == "platform" else m["tenant_id"]),
                        m["project_name"] or (m["project_id"] or "-"),
                        "*" if m["project_id"] and str(m["project_id"]) == selected else "",
                    ]
                    for m in me["memberships"]
                ],
            )
        )

    emit(st, run(call(st, go)), render)


def use(
    ctx: typer.Context,
    project: Annotated[str, typer.Argument(help="Project: id, name, tenant/name or a unique id prefix")],
) -> None:
    """Select the project later commands act in."""
    st = state_of(ctx)

    async def go(c: Client) -> Project:
        return await c.project(await lookup.project(c, project))

    p: Project = run(call(st, go))
    st.config.project_id = str(p.project_id)
    st.config.save()
    emit(st, p, lambda p: out.print(f"Using project [bold]{p.name}[/bold] ({p.project_id})"))
