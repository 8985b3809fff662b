"""The `gpuaas` command line: login, allocations (with a live timeline), keys, grants, volumes, apps, cost.

Every command prints a table (rich) or, with `--json`, the API's JSON. A problem answered by the platform
is printed as `error: <detail> (<code>)` and the command exits 1; a connection failure exits 2.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

import httpx
import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from gpuaas.cli import sso as sso_flow
from gpuaas.cli.config import Config, resolve_url
from gpuaas.sdk import ApiError, Client

T = TypeVar("T")
out = Console()
err = Console(stderr=True)

app = typer.Typer(help="GPUaaS from the command line.", no_args_is_help=True, pretty_exceptions_enable=False)
alloc_app = typer.Typer(help="Allocations: create, list, show, ssh, restart, resize, release.", no_args_is_help=True)
keys_app = typer.Typer(help="Your personal SSH keys.", no_args_is_help=True)
grants_app = typer.Typer(help="SSH grants: another project member's key on one allocation.", no_args_is_help=True)
volumes_app = typer.Typer(help="Project volumes.", no_args_is_help=True)
apps_app = typer.Typer(help="The app catalog and your app instances.", no_args_is_help=True)
app.add_typer(alloc_app, name="alloc")
app.add_typer(keys_app, name="keys")
app.add_typer(grants_app, name="grants")
app.add_typer(volumes_app, name="volumes")
app.add_typer(apps_app, name="apps")

A = "/api/allocations"
R = "/api/app-runtime"
ALLOC_SETTLED = {"active", "failed", "released", "release_failed"}
INSTANCE_SETTLED = {"running", "degraded", "failed", "stopped", "decommissioned", "decommission_failed"}


@dataclass
class State:
    url_flag: str | None = None
    json: bool = False
    project: str | None = None
    config: Config = field(default_factory=Config.load)

    @property
    def url(self) -> str:
        return resolve_url(self.url_flag, self.config)


def _state(ctx: typer.Context) -> State:
    return ctx.ensure_object(State)


@app.callback()
def _root(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Option(help="Gateway URL (else GPUAAS_URL, config, .local/stack.json)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables")] = False,
    project: Annotated[
        str | None, typer.Option(envvar="GPUAAS_PROJECT", help="Project id (else the selected one)")
    ] = None,
) -> None:
    ctx.obj = State(url_flag=url, json=as_json, project=project)


# ------------------------------------------------------------------------------------------- plumbing


def run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        return asyncio.run(coro)
    except ApiError as exc:
        detail = exc.problem.get("detail") or exc.problem.get("title") or ""
        err.print(f"[red]error:[/red] {detail} ({exc.code}, HTTP {exc.status})", highlight=False)
        raise typer.Exit(1) from None
    except httpx.HTTPError as exc:
        err.print(f"[red]error:[/red] cannot reach the platform: {exc.__class__.__name__} {exc}", highlight=False)
        raise typer.Exit(2) from None
    except TimeoutError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(3) from None


def client(st: State, *, authenticated: bool = True) -> Client:
    cfg = st.config

    async def refresh() -> str:
        if not cfg.refresh_token:
            raise ApiError(401, {"code": "not_signed_in", "detail": "Not signed in: run `gpuaas login`."})
        async with httpx.AsyncClient(base_url=st.url, timeout=30) as http:
            r = await http.post(
                "/api/identity/auth/token", data={"grant_type": "refresh_token", "refresh_token": cfg.refresh_token}
            )
        if r.status_code >= 400:
            cfg.access_token = cfg.refresh_token = None
            cfg.save()
            raise ApiError(r.status_code, _problem(r) | {"detail": "Your session ended: run `gpuaas login`."})
        body = r.json()
        cfg.access_token, cfg.refresh_token = body["access_token"], body.get("refresh_token") or cfg.refresh_token
        cfg.save()
        return str(cfg.access_token)

    return Client(st.url, token=cfg.access_token if authenticated else None, token_provider=refresh)


def _problem(r: httpx.Response) -> dict[str, Any]:
    try:
        return dict(r.json())
    except ValueError:
        return {"code": "http_error", "detail": r.text[:300]}


def emit(st: State, data: Any, render: Callable[[Any], Any] | None = None) -> None:
    if st.json or render is None:
        out.print_json(json.dumps(data, default=str))
    else:
        render(data)


def table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    for row in rows:
        t.add_row(*("" if v is None else str(v) for v in row))
    return t


async def project_id(st: State, c: Client) -> str:
    if st.project:
        return st.project
    if st.config.project_id:
        return st.config.project_id
    me = await c.request("GET", "/api/identity/me")
    for m in me.get("memberships", []):
        if m.get("project_id"):
            return str(m["project_id"])
    raise ApiError(422, {"code": "project_required", "detail": "No project: pass --project or run `gpuaas use`."})


# ------------------------------------------------------------------------------------------- identity


@app.command()
def login(
    ctx: typer.Context,
    email: Annotated[str | None, typer.Option(help="Your email")] = None,
    password: Annotated[str | None, typer.Option(envvar="GPUAAS_PASSWORD", help="Else prompted")] = None,
    sso: Annotated[bool, typer.Option(help="Single sign-on: discover your organisation's IdP and open it")] = False,
    browser: Annotated[bool, typer.Option(help="Open the sign-in page in a browser (--sso)")] = True,
    timeout: Annotated[float, typer.Option(help="Seconds --sso waits for the browser sign-in")] = 300,
) -> None:
    """Sign in (password, or --sso for a work account with single sign-on in the browser)."""
    st = _state(ctx)
    email = email or typer.prompt("Email")

    async def go() -> dict[str, Any]:
        async with client(st, authenticated=False) as c:
            found = await c.request("GET", "/api/identity/auth/discover", params={"email": email}, authenticated=False)
            idp = found.get("identity_provider") or {}
            if sso or idp.get("enforce_sso"):
                if not idp:
                    raise ApiError(
                        422,
                        {
                            "code": "sso_not_configured",
                            "detail": "no single sign-on is set up for this email's domain: use your password",
                        },
                    )
                return await _sso_login(st, c, found, email, open_browser=browser, timeout_s=timeout)
            pw = password or typer.prompt("Password", hide_input=True)
            body = await c.request(
                "POST",
                "/api/identity/auth/token",
                data={"grant_type": "password", "username": email, "password": pw},
                authenticated=False,
            )
            return await _signed_in(st, c, email, body)

    result = run(go())
    emit(st, result, lambda r: out.print(f"Signed in as [bold]{r['signed_in']}[/bold] on {r['url']}"))


async def _sso_login(
    st: State, c: Client, found: dict[str, Any], email: str, *, open_browser: bool, timeout_s: float
) -> dict[str, Any]:
    """The browser flow: a loopback listener receives the single-use login code, exchanged here with the
    PKCE verifier whose challenge the start carried."""
    idp = found["identity_provider"]
    with sso_flow.LoopbackListener() as listener:
        url = sso_flow.start_url(
            idp["sso_start_url"], email=email, return_to=listener.redirect_uri, code_verifier=listener.code_verifier
        )
        err.print(f"Work account of {found['tenant']['name']}: sign in with {idp['name']} in your browser:")
        err.print(f"  {url}", highlight=False, soft_wrap=True)
        err.print("Waiting for the sign-in to finish…")
        if open_browser:
            import webbrowser

            webbrowser.open(url)
        back = await asyncio.to_thread(listener.wait, timeout_s)
    if back.get("error"):
        raise ApiError(401, {"code": back["error"], "detail": back.get("error_description") or "sign-in refused"})
    body = await c.request(
        "POST",
        "/api/identity/auth/token",
        data={
            "grant_type": "sso_login_code",
            "code": back.get("login_code", ""),
            "code_verifier": listener.code_verifier,
        },
        authenticated=False,
    )
    return {**await _signed_in(st, c, email, body), "method": "sso", "link_method": body.get("link_method")}


async def _signed_in(st: State, c: Client, email: str, body: dict[str, Any]) -> dict[str, Any]:
    """Keep the session (config file, 0600) and select the first project when none is selected (another
    user's selection is dropped)."""
    if st.config.email and st.config.email.lower() != email.lower():
        st.config.project_id = None
    st.config.url, st.config.email = st.url, email
    st.config.access_token, st.config.refresh_token = body["access_token"], body.get("refresh_token")
    st.config.save()
    c.token = body["access_token"]
    me = await c.request("GET", "/api/identity/me")
    if not st.config.project_id:
        st.config.project_id = next((str(m["project_id"]) for m in me["memberships"] if m.get("project_id")), None)
        st.config.save()
    return {"signed_in": me["email"], "user_id": me["user_id"], "project_id": st.config.project_id, "url": st.url}


@app.command()
def logout(ctx: typer.Context) -> None:
    """Revoke this session and forget the tokens."""
    st = _state(ctx)

    async def go() -> None:
        if st.config.access_token:
            async with client(st) as c:
                try:
                    await c.request(
                        "POST", "/api/identity/auth/logout", data={"refresh_token": st.config.refresh_token or ""}
                    )
                except ApiError:
                    pass

    run(go())
    st.config.access_token = st.config.refresh_token = None
    st.config.save()
    emit(st, {"signed_out": True}, lambda _: out.print("Signed out."))


@app.command()
def whoami(ctx: typer.Context) -> None:
    """Who is signed in, and their memberships."""
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            return await c.request("GET", "/api/identity/me")

    me = run(go())
    emit(
        st,
        me,
        lambda m: out.print(
            table(
                f"{m['email']} ({m['user_id']})",
                ["scope", "role", "tenant", "project"],
                [[x["scope"], x["role"], x.get("tenant_id"), x.get("project_id")] for x in m["memberships"]],
            )
        ),
    )


@app.command()
def use(ctx: typer.Context, project: Annotated[str, typer.Argument(help="Project id")]) -> None:
    """Select the project later commands act in."""
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            return await c.request("GET", f"/api/identity/projects/{project}")

    p = run(go())
    st.config.project_id = p["project_id"]
    st.config.save()
    emit(st, p, lambda p: out.print(f"Using project [bold]{p['name']}[/bold] ({p['project_id']})"))


# ------------------------------------------------------------------------------------------ allocations


def _alloc_rows(items: list[dict[str, Any]]) -> Table:
    return table(
        "Allocations",
        ["id", "name", "status", "GPUs", "shape", "SSH", "failure"],
        [
            [
                a["allocation_id"],
                a["name"],
                a["status"],
                f"{a['gpu_count']} x {a['gpu_model']}",
                a["shape"],
                _ssh_line(a) or "-",
                a.get("failure_reason") or "",
            ]
            for a in items
        ],
    )


def _ssh_line(a: dict[str, Any]) -> str | None:
    ep = a.get("ssh_endpoint")
    return f"ssh -p {ep['port']} {ep['username']}@{ep['host']}" if ep else None


async def wait_allocation(st: State, c: Client, allocation_id: str, done: set[str], timeout_s: float) -> dict[str, Any]:
    """Follow the timeline (a live table of phases) until the allocation reaches one of `done`."""
    after = 0
    entries: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s

    def view(alloc: dict[str, Any]) -> Table:
        t = table(
            f"{alloc['name']}: {alloc['status']}",
            ["phase", "status", "message", "started", "finished"],
            [[e["phase"], e["status"], e["message"], e["started_at"], e.get("finished_at")] for e in entries],
        )
        return t

    alloc = await c.request("GET", f"{A}/allocations/{allocation_id}")
    live = (
        None
        if st.json or (not out.is_terminal and os.environ.get("GPUAAS_PROGRESS") != "1")
        else Live(view(alloc), console=err)
    )
    try:
        if live:
            live.start()
        while True:
            new = await c.request("GET", f"{A}/allocations/{allocation_id}/timeline", params={"after": after})
            for e in new:
                after = max(after, e["seq"])
                entries.append(e)
                if live is None and not st.json:
                    err.print(f"  {e['phase']:<12} {e['status']:<10} {e['message']}", highlight=False)
            alloc = await c.request("GET", f"{A}/allocations/{allocation_id}")
            if live:
                live.update(view(alloc))
            if alloc["status"] in done:
                return alloc
            if time.monotonic() > deadline:
                raise TimeoutError(f"allocation {allocation_id} is still {alloc['status']} after {timeout_s:.0f}s")
            await asyncio.sleep(0.5)
    finally:
        if live:
            live.stop()


Wait = Annotated[bool, typer.Option("--wait", help="Follow the timeline until the change settles")]
Timeout = Annotated[float, typer.Option(help="Seconds --wait waits at most")]


@alloc_app.command("create")
def alloc_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Option(help="Allocation name")] = "workspace",
    gpus: Annotated[int | None, typer.Option(help="GPU count (gpu_slice)")] = 1,
    model: Annotated[str, typer.Option(help="GPU model")] = "H100-80GB",
    shape: Annotated[str, typer.Option(help="gpu_slice or baremetal")] = "gpu_slice",
    host_class: Annotated[str | None, typer.Option(help="Pin a host class")] = None,
    volume: Annotated[list[str] | None, typer.Option(help="Volume id to attach (repeatable)")] = None,
    wait: Wait = False,
    timeout: Timeout = 300,
) -> None:
    """Create an allocation (with --wait: until it is active or failed)."""
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            pid = await project_id(st, c)
            body = {
                "name": name,
                "shape": shape,
                "gpu_model": model,
                "gpu_count": None if shape == "baremetal" else gpus,
                "host_class": host_class,
                "volume_ids": volume or [],
            }
            a = await c.request("POST", f"{A}/projects/{pid}/allocations", json=body, idempotency_key=_key())
            if wait:
                a = await wait_allocation(st, c, a["allocation_id"], ALLOC_SETTLED, timeout)
            return a

    a = run(go())
    emit(st, a, lambda a: out.print(_alloc_rows([a])))
    if wait and a["status"] != "active":
        raise typer.Exit(1)


@alloc_app.command("list")
def alloc_list(ctx: typer.Context, released: Annotated[bool, typer.Option(help="Include released")] = False) -> None:
    """Allocations of the project."""
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            pid = await project_id(st, c)
            return await c.request("GET", f"{A}/projects/{pid}/allocations", params={"include_released": released})

    emit(st, run(go()), lambda items: out.print(_alloc_rows(items)))


@alloc_app.command("show")
def alloc_show(ctx: typer.Context, allocation_id: str) -> None:
    """One allocation with its timeline."""
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            a = await c.request("GET", f"{A}/allocations/{allocation_id}")
            a["timeline"] = await c.request("GET", f"{A}/allocations/{allocation_id}/timeline")
            return a

    def render(a: dict[str, Any]) -> None:
        out.print(_alloc_rows([a]))
        if a.get("after_release"):
            out.print(f"After release: {a['after_release']}")
        out.print(
            table(
                "Timeline",
                ["phase", "status", "message", "started"],
                [[e["phase"], e["status"], e["message"], e["started_at"]] for e in a["timeline"]],
            )
        )

    emit(st, run(go()), render)


@alloc_app.command("ssh")
def alloc_ssh(
    ctx: typer.Context,
    allocation_id: str,
    identity: Annotated[Path | None, typer.Option("-i", help="Private key file")] = None,
    print_only: Annotated[bool, typer.Option("--print", help="Print the ssh command instead of running it")] = False,
    command: Annotated[list[str] | None, typer.Argument(help="Remote command")] = None,
) -> None:
    """SSH into an allocation (runs OpenSSH's ssh)."""
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            return await c.request("GET", f"{A}/allocations/{allocation_id}")

    a = run(go())
    ep = a.get("ssh_endpoint")
    if not ep:
        err.print(f"[red]error:[/red] allocation is {a['status']}: no SSH endpoint yet")
        raise typer.Exit(1)
    argv = ["ssh", "-p", str(ep["port"]), "-o", "StrictHostKeyChecking=accept-new"]
    if identity:
        argv += ["-i", str(identity)]
    argv += [f"{ep['username']}@{ep['host']}", *(command or [])]
    if print_only or st.json:
        emit(st, {"argv": argv}, lambda d: out.print(shlex.join(d["argv"])))
        return
    os.execvp("ssh", argv)


def _alloc_action(
    ctx: typer.Context, allocation_id: str, path: str, body: Any, wait: bool, timeout: float, done: set[str]
) -> None:
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            a = await c.request("POST", f"{A}/allocations/{allocation_id}/{path}", json=body, idempotency_key=_key())
            if wait:
                a = await wait_allocation(st, c, allocation_id, done, timeout)
            return a

    a = run(go())
    emit(st, a, lambda a: out.print(_alloc_rows([a])))
    if wait and a["status"] in {"failed", "release_failed"}:
        raise typer.Exit(1)


@alloc_app.command("restart")
def alloc_restart(ctx: typer.Context, allocation_id: str, wait: Wait = False, timeout: Timeout = 300) -> None:
    """Restart in place (same id, host, endpoint, keys and volumes)."""
    _alloc_action(ctx, allocation_id, "restart", {}, wait, timeout, {"active", "failed"})


@alloc_app.command("resize")
def alloc_resize(ctx: typer.Context, allocation_id: str, gpus: int, wait: Wait = False, timeout: Timeout = 300) -> None:
    """Change the GPU count of a gpu_slice allocation."""
    _alloc_action(ctx, allocation_id, "resize", {"gpu_count": gpus}, wait, timeout, {"active", "failed"})


@alloc_app.command("release")
def alloc_release(ctx: typer.Context, allocation_id: str, wait: Wait = False, timeout: Timeout = 300) -> None:
    """Release (billing stops at the request)."""
    _alloc_action(ctx, allocation_id, "release", {}, wait, timeout, {"released", "release_failed"})


@alloc_app.command("retry-release")
def alloc_retry_release(ctx: typer.Context, allocation_id: str, wait: Wait = False, timeout: Timeout = 300) -> None:
    """Retry a release that failed."""
    _alloc_action(ctx, allocation_id, "retry-release", {}, wait, timeout, {"released", "release_failed"})


# ------------------------------------------------------------------------------------- keys, grants, volumes


@keys_app.command("list")
def keys_list(ctx: typer.Context) -> None:
    st = _state(ctx)
    emit(
        st,
        run(_call(st, "GET", f"{A}/ssh-keys")),
        lambda ks: out.print(
            table("SSH keys", ["id", "name", "fingerprint"], [[k["key_id"], k["name"], k["fingerprint"]] for k in ks])
        ),
    )


@keys_app.command("add")
def keys_add(ctx: typer.Context, name: str, public_key_file: Path) -> None:
    st = _state(ctx)
    body = {"name": name, "public_key": public_key_file.read_text().strip()}
    emit(
        st,
        run(_call(st, "POST", f"{A}/ssh-keys", json=body)),
        lambda k: out.print(f"Added {k['name']} {k['fingerprint']}"),
    )


@keys_app.command("delete")
def keys_delete(ctx: typer.Context, key_id: str) -> None:
    st = _state(ctx)
    run(_call(st, "DELETE", f"{A}/ssh-keys/{key_id}"))
    emit(st, {"deleted": key_id}, lambda _: out.print("Deleted."))


@grants_app.command("list")
def grants_list(ctx: typer.Context, allocation_id: str) -> None:
    st = _state(ctx)
    emit(
        st,
        run(_call(st, "GET", f"{A}/allocations/{allocation_id}/ssh-grants")),
        lambda gs: out.print(
            table(
                "SSH grants",
                ["id", "user", "fingerprint", "status"],
                [[g["grant_id"], g.get("user_id"), g["fingerprint"], g["status"]] for g in gs],
            )
        ),
    )


@grants_app.command("add")
def grants_add(ctx: typer.Context, allocation_id: str, user_id: str, public_key_file: Path) -> None:
    st = _state(ctx)
    body = {"user_id": user_id, "public_key": public_key_file.read_text().strip()}
    g = run(_call(st, "POST", f"{A}/allocations/{allocation_id}/ssh-grants", json=body))
    emit(st, g, lambda g: out.print(f"Granted {g['user_id']} ({g['fingerprint']}): {g['status']}"))


@grants_app.command("remove")
@grants_app.command("revoke", hidden=True)
def grants_remove(ctx: typer.Context, allocation_id: str, grant_id: str) -> None:
    """Revoke a grant: the key is removed from the allocation."""
    st = _state(ctx)
    g = run(_call(st, "DELETE", f"{A}/allocations/{allocation_id}/ssh-grants/{grant_id}"))
    emit(st, g, lambda g: out.print(f"Revoked {g['fingerprint']}: {g['status']}"))


def _volume_rows(vs: list[dict[str, Any]]) -> Table:
    return table(
        "Volumes",
        ["id", "name", "size", "mode", "status", "after release"],
        [
            [v["volume_id"], v["name"], f"{v['size_gb']} GB", v["access_mode"], v["status"], v["after_release"]]
            for v in vs
        ],
    )


@volumes_app.command("list")
def volumes_list(ctx: typer.Context) -> None:
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            return await c.request("GET", f"{A}/projects/{await project_id(st, c)}/volumes")

    emit(st, run(go()), lambda vs: out.print(_volume_rows(vs)))


@volumes_app.command("create")
def volumes_create(
    ctx: typer.Context,
    name: str,
    size_gb: Annotated[int, typer.Option("--size", help="Size in GB")] = 100,
    persist: Annotated[bool, typer.Option(help="Keep the data after release")] = True,
    mode: Annotated[str, typer.Option(help="single_writer or multi_attach")] = "single_writer",
) -> None:
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            body = {"name": name, "size_gb": size_gb, "persist": persist, "access_mode": mode}
            return await c.request("POST", f"{A}/projects/{await project_id(st, c)}/volumes", json=body)

    emit(st, run(go()), lambda v: out.print(_volume_rows([v])))


@volumes_app.command("delete")
def volumes_delete(ctx: typer.Context, volume_id: str) -> None:
    st = _state(ctx)
    run(_call(st, "DELETE", f"{A}/volumes/{volume_id}"))
    emit(st, {"deleted": volume_id}, lambda _: out.print("Deleted."))


# ------------------------------------------------------------------------------------------------ apps


@apps_app.command("list")
def apps_list(ctx: typer.Context) -> None:
    """Apps your organisation may deploy: app version and runtime version, separately."""
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            pid = await project_id(st, c)
            project = await c.request("GET", f"/api/identity/projects/{pid}")
            return await c.request("GET", "/api/catalog/apps", params={"tenant_id": project["tenant_id"]})

    emit(
        st,
        run(go()),
        lambda apps: out.print(
            table(
                "Apps",
                ["slug", "name", "version", "runtime", "kind", "inputs"],
                [
                    [
                        a["slug"],
                        a["display_name"],
                        a["version"],
                        a.get("runtime_version"),
                        a["artifact_kind"],
                        ", ".join((a.get("inputs") or {}).get("properties", {})),
                    ]
                    for a in apps
                ],
            )
        ),
    )


def _parse_config(pairs: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"{pair!r}: use KEY=VALUE", param_hint="--config")
        try:
            config[key] = json.loads(value)
        except ValueError:
            config[key] = value
    return config


def _instance_view(i: dict[str, Any]) -> Table:
    t = table(
        f"{i['name']} ({i['app_slug']} {i['app_version']}): {i['status']}",
        ["member", "component", "allocation", "status"],
        [
            [
                m["member_id"],
                m["component_key"],
                m["allocation_id"],
                m["status"] + (" (tombstone)" if m.get("tombstoned") else ""),
            ]
            for m in i.get("members", [])
        ],
    )
    return t


async def _instance(c: Client, instance_id: str) -> dict[str, Any]:
    i = await c.request("GET", f"{R}/instances/{instance_id}")
    i["members"] = (await c.request("GET", f"{R}/instances/{instance_id}/members"))["items"]
    i["operations"] = (await c.request("GET", f"{R}/instances/{instance_id}/operations"))["items"]
    return i


async def wait_instance(st: State, c: Client, instance_id: str, done: set[str], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    seen: set[int] = set()
    while True:
        after = max(seen, default=0)
        events = await c.request("GET", f"{R}/instances/{instance_id}/events", params={"after": after})
        for e in events["items"]:  # a page, like every app-runtime list
            if e["seq"] not in seen:
                seen.add(e["seq"])
                if not st.json:
                    err.print(f"  {e['kind']:<24} {e['message']}", highlight=False)
        i = await _instance(c, instance_id)
        if i["status"] in done:
            return i
        if time.monotonic() > deadline:
            raise TimeoutError(f"instance {instance_id} is still {i['status']} after {timeout_s:.0f}s")
        await asyncio.sleep(0.5)


@apps_app.command("deploy")
def apps_deploy(
    ctx: typer.Context,
    slug: str,
    name: Annotated[str, typer.Option(help="Instance name")],
    controller: Annotated[str, typer.Option(help="Allocation id for the controller member")],
    worker: Annotated[list[str] | None, typer.Option(help="Worker allocation id (repeatable)")] = None,
    config: Annotated[list[str] | None, typer.Option("--config", "-c", help="KEY=VALUE of the app's inputs")] = None,
    mode: Annotated[str, typer.Option(help="same_node or split")] = "split",
    version: Annotated[str | None, typer.Option(help="App version (default: the active one)")] = None,
    wait: Wait = False,
    timeout: Timeout = 300,
) -> None:
    """Deploy an app onto your allocations; --config collects the manifest's inputs."""
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            pid = await project_id(st, c)
            body = {
                "name": name,
                "app_slug": slug,
                "app_version": version,
                "config": _parse_config(config or []),
                "placement_intent": {
                    "mode": mode,
                    "controller_allocation_id": controller,
                    "worker_allocation_ids": worker or [],
                },
            }
            i = await c.request("POST", f"{R}/projects/{pid}/instances", json=body, idempotency_key=_key())
            if wait:
                return await wait_instance(st, c, i["instance_id"], INSTANCE_SETTLED, timeout)
            return await _instance(c, i["instance_id"])

    i = run(go())
    emit(st, i, lambda i: out.print(_instance_view(i)))
    if wait and i["status"] not in {"running", "degraded"}:
        raise typer.Exit(1)


@apps_app.command("status")
def apps_status(ctx: typer.Context, instance_id: Annotated[str | None, typer.Argument()] = None) -> None:
    """One instance (members, operations), or every instance of the project."""
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            if instance_id:
                return await _instance(c, instance_id)
            pid = await project_id(st, c)
            return (await c.request("GET", f"{R}/instances", params={"project_id": pid}))["items"]

    def render(data: Any) -> None:
        if isinstance(data, list):
            out.print(
                table(
                    "Instances",
                    ["id", "name", "app", "version", "status"],
                    [[i["instance_id"], i["name"], i["app_slug"], i["app_version"], i["status"]] for i in data],
                )
            )
        else:
            out.print(_instance_view(data))
            out.print(
                table(
                    "Operations",
                    ["kind", "component", "status", "progress", "error"],
                    [
                        [o["kind"], o.get("component_key"), o["status"], o.get("progress_message"), o.get("error")]
                        for o in data["operations"]
                    ],
                )
            )

    emit(st, run(go()), render)


@apps_app.command("add-worker")
def apps_add_worker(
    ctx: typer.Context,
    instance_id: str,
    allocation_id: str,
    component: Annotated[str | None, typer.Option(help="Member role (default: the manifest's worker role)")] = None,
) -> None:
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            key = component
            if key is None:
                inst = await c.request("GET", f"{R}/instances/{instance_id}")
                roles = (await c.request("GET", f"/api/catalog/manifests/{inst['manifest_id']}")).get("roles") or []
                key = roles[-1]["key"] if roles else "worker"
            body = {"kind": "add", "allocation_id": allocation_id, "component_key": key}
            return await c.request("POST", f"{R}/instances/{instance_id}/operations", json=body, idempotency_key=_key())

    emit(
        st,
        run(go()),
        lambda o: out.print(f"Requested {o['kind']} of {o.get('component_key')}: {o['status']} ({o['operation_id']})"),
    )


@apps_app.command("remove-worker")
def apps_remove_worker(ctx: typer.Context, instance_id: str, member_id: str) -> None:
    st = _state(ctx)
    body = {"kind": "remove", "member_id": member_id}
    o = run(_call(st, "POST", f"{R}/instances/{instance_id}/operations", json=body))
    emit(st, o, lambda o: out.print(f"Requested remove: {o['status']} ({o['operation_id']})"))


@apps_app.command("decommission")
def apps_decommission(
    ctx: typer.Context,
    instance_id: str,
    reason: Annotated[str, typer.Option(help="Why (audited)")] = "decommissioned with the CLI",
    wait: Wait = False,
    timeout: Timeout = 300,
) -> None:
    """Decommission: done only when the controller verified every member's teardown."""
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            await c.request(
                "POST", f"{R}/instances/{instance_id}/decommission", json={"reason": reason}, idempotency_key=_key()
            )
            if wait:
                return await wait_instance(st, c, instance_id, {"decommissioned", "decommission_failed"}, timeout)
            return await _instance(c, instance_id)

    i = run(go())
    emit(st, i, lambda i: out.print(_instance_view(i)))
    if wait and i["status"] != "decommissioned":
        raise typer.Exit(1)


# ------------------------------------------------------------------------------------------------ cost


@app.command()
def cost(
    ctx: typer.Context,
    period: Annotated[str | None, typer.Option(help="YYYY-MM (default: the current period)")] = None,
    tenant: Annotated[str | None, typer.Option(help="Tenant id: the whole tenant (tenant admins)")] = None,
) -> None:
    """Combined cost (GPU time + app usage) of the current period, per project."""
    st = _state(ctx)

    async def go() -> Any:
        async with client(st) as c:
            params = {"tenant_id": tenant} if tenant else {"project_id": await project_id(st, c)}
            if period:
                params["period"] = period
            return await c.request("GET", "/api/billing/costs", params=params)

    def render(data: dict[str, Any]) -> None:
        totals = " + ".join(f"{t['amount']} {t['currency']}" for t in data["totals"]) or "0"
        out.print(f"Period {data['period_start']} to {data['period_end']}: [bold]{totals}[/bold]")
        out.print(
            table(
                "Per project",
                ["project", "GPU time", "app usage", "total"],
                [
                    [
                        p["project_id"],
                        f"{p['gpu_amount']} {p['currency']}",
                        f"{p['app_amount']} {p['currency']}",
                        f"{p['amount']} {p['currency']}",
                    ]
                    for p in data["projects"]
                ],
            )
        )

    emit(st, run(go()), render)


# ------------------------------------------------------------------------------------------------ misc


async def _call(st: State, method: str, path: str, **kwargs: Any) -> Any:
    async with client(st) as c:
        if method == "POST":
            kwargs.setdefault("idempotency_key", _key())
        return await c.request(method, path, **kwargs)


def _key() -> str:
    import uuid

    return str(uuid.uuid4())


def main() -> None:
    app()
