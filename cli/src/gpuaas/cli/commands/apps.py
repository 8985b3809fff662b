"""`gpuaas apps`: the app catalog (what your organisation may deploy) and your app instances: deploy,
status, add/remove a worker, drain a member, decommission, open (a launchable app in the browser); `--wait` follows the
instance's timeline until it settles. An INSTANCE, an allocation or a member is an id, a name or a unique id
prefix (the short id the tables show)."""

from __future__ import annotations

import asyncio
import json
import time
import webbrowser
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlencode

import typer
from rich.table import Table

from gpuaas.cli import lookup
from gpuaas.cli.commands.allocations import Timeout, Wait, allocation_ref
from gpuaas.cli.context import State, client, new_key, project_id, run, state_of
from gpuaas.cli.output import emit, err, out, plain, table
from gpuaas.cli.refs import is_uuid, short_ids
from gpuaas.sdk import Client
from gpuaas.sdk.models import Instance, InstanceStatus, Manifest, Member, Operation

app = typer.Typer(help="The app catalog and your app instances.", no_args_is_help=True)

Status = InstanceStatus
SETTLED = {
    Status.running,
    Status.degraded,
    Status.failed,
    Status.stopped,
    Status.decommissioned,
    Status.decommission_failed,
}
DECOMMISSION_SETTLED = {Status.decommissioned, Status.decommission_failed}
InstanceRef = Annotated[str, typer.Argument(metavar="INSTANCE", help="Id, name or unique id prefix")]


async def instance_ref(st: State, c: Client, ref: str) -> str:
    """The app instance `ref` names in the project (a full id is taken as it is)."""
    return ref if is_uuid(ref) else await lookup.instance(c, await project_id(st, c), ref)


@dataclass
class InstanceDetail:
    """One instance with its members and operations (what `status`, `deploy` and `decommission` show)."""

    instance: Instance
    members: list[Member]
    operations: list[Operation]

    @property
    def status(self) -> InstanceStatus:
        return self.instance.status

    def as_json(self) -> Any:
        return {**plain(self.instance), "members": plain(self.members), "operations": plain(self.operations)}


def parse_config(pairs: list[str]) -> dict[str, Any]:
    """`-c KEY=VALUE` pairs; a VALUE that reads as JSON (a number, true, a list) is taken as JSON."""
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


def instance_view(d: InstanceDetail) -> Table:
    i = d.instance
    members = short_ids(m.member_id for m in d.members)
    return table(
        f"{i.name} ({i.app_slug} {i.app_version}): {i.status}",
        ["member", "component", "allocation", "status"],
        [
            [
                members[str(m.member_id)],
                m.component_key,
                m.allocation_id,
                m.status + (" (tombstone)" if m.tombstoned else ""),
            ]
            for m in d.members
        ],
    )


async def instance_detail(c: Client, instance_id: str) -> InstanceDetail:
    return InstanceDetail(await c.instance(instance_id), await c.members(instance_id), await c.operations(instance_id))


async def wait_instance(
    st: State, c: Client, instance_id: str, done: set[InstanceStatus], timeout_s: float
) -> InstanceDetail:
    """Print the instance's timeline as it grows until its status is one of `done`."""
    deadline = time.monotonic() + timeout_s
    seen: set[int] = set()
    while True:
        for e in await c.timeline(instance_id, after=max(seen, default=0)):
            if e.seq not in seen:
                seen.add(e.seq)
                if not st.json:
                    err.print(f"  {e.kind:<24} {e.message}", highlight=False)
        d = await instance_detail(c, instance_id)
        if d.status in done:
            return d
        if time.monotonic() > deadline:
            raise TimeoutError(f"instance {instance_id} is still {d.status} after {timeout_s:.0f}s")
        await asyncio.sleep(0.5)


@app.command("list")
def list_(ctx: typer.Context) -> None:
    """Apps your organisation may deploy: app version and runtime version, separately."""
    st = state_of(ctx)

    async def go() -> list[Manifest]:
        async with client(st) as c:
            project = await c.project(await project_id(st, c))
            return await c.apps(tenant_id=project.tenant_id)

    emit(
        st,
        run(go()),
        lambda apps: out.print(
            table(
                "Apps",
                ["slug", "name", "version", "runtime", "kind", "inputs"],
                [
                    [
                        a.slug,
                        a.display_name,
                        a.version,
                        a.runtime_version,
                        a.artifact_kind,
                        ", ".join((a.inputs or {}).get("properties", {})),
                    ]
                    for a in apps
                ],
            )
        ),
    )


@app.command("deploy")
def deploy(
    ctx: typer.Context,
    slug: str,
    name: Annotated[str, typer.Option(help="Instance name")],
    controller: Annotated[str, typer.Option(help="Allocation (id, name or short id) for the controller member")],
    worker: Annotated[
        list[str] | None, typer.Option(help="Worker allocation (id, name or short id); repeatable")
    ] = None,
    config: Annotated[list[str] | None, typer.Option("--config", "-c", help="KEY=VALUE of the app's inputs")] = None,
    mode: Annotated[str, typer.Option(help="same_node or split")] = "split",
    version: Annotated[str | None, typer.Option(help="App version (default: the active one)")] = None,
    wait: Wait = False,
    timeout: Timeout = 300,
) -> None:
    """Deploy an app onto your allocations; --config collects the manifest's inputs."""
    st = state_of(ctx)

    async def go() -> InstanceDetail:
        async with client(st) as c:
            controller_id = await allocation_ref(st, c, controller)
            worker_ids = [await allocation_ref(st, c, w) for w in worker or []]
            i = await c.deploy(
                await project_id(st, c),
                name=name,
                app_slug=slug,
                app_version=version,
                config=parse_config(config or []),
                placement={
                    "mode": mode,
                    "controller_allocation_id": controller_id,
                    "worker_allocation_ids": worker_ids,
                },
                idempotency_key=new_key(),
            )
            if wait:
                return await wait_instance(st, c, str(i.instance_id), SETTLED, timeout)
            return await instance_detail(c, str(i.instance_id))

    d = run(go())
    emit(st, d, lambda d: out.print(instance_view(d)))
    if wait and d.status not in {Status.running, Status.degraded}:
        raise typer.Exit(1)


@app.command("status")
def status(
    ctx: typer.Context,
    instance: Annotated[str | None, typer.Argument(metavar="[INSTANCE]", help="Id, name or unique id prefix")] = None,
) -> None:
    """One instance (members, operations), or every instance of the project."""
    st = state_of(ctx)

    async def go() -> InstanceDetail | list[Instance]:
        async with client(st) as c:
            if instance:
                return await instance_detail(c, await instance_ref(st, c, instance))
            return await c.instances(project_id=await project_id(st, c))

    def render(data: InstanceDetail | list[Instance]) -> None:
        if isinstance(data, list):
            shorts = short_ids(i.instance_id for i in data)
            out.print(
                table(
                    "Instances",
                    ["id", "name", "app", "version", "status"],
                    [[shorts[str(i.instance_id)], i.name, i.app_slug, i.app_version, i.status] for i in data],
                )
            )
        else:
            out.print(instance_view(data))
            out.print(
                table(
                    "Operations",
                    ["kind", "component", "status", "progress", "error"],
                    [[o.kind, o.component_key, o.status, o.progress_message, o.error] for o in data.operations],
                )
            )

    emit(st, run(go()), render)


@app.command("add-worker")
def add_worker(
    ctx: typer.Context,
    instance: InstanceRef,
    allocation: Annotated[str, typer.Argument(metavar="ALLOCATION", help="Id, name or unique id prefix")],
    component: Annotated[str | None, typer.Option(help="Member role (default: the manifest's worker role)")] = None,
) -> None:
    st = state_of(ctx)

    async def go() -> Operation:
        async with client(st) as c:
            return await request_add(c, await instance_ref(st, c, instance), await allocation_ref(st, c, allocation))

    async def request_add(c: Client, instance_id: str, allocation_id: str) -> Operation:
        key = component
        if key is None:
            manifest = await c.manifest((await c.instance(instance_id)).manifest_id)
            roles = manifest.roles or []
            key = roles[-1]["key"] if roles else "worker"
        return await c.request_operation(
            instance_id, "add", allocation_id=allocation_id, component_key=key, idempotency_key=new_key()
        )

    emit(
        st,
        run(go()),
        lambda o: out.print(f"Requested {o.kind} of {o.component_key}: {o.status} ({o.operation_id})"),
    )


@app.command("remove-worker")
def remove_worker(
    ctx: typer.Context,
    instance: InstanceRef,
    member: Annotated[str, typer.Argument(metavar="MEMBER", help="Member id or short id, or its allocation's id")],
) -> None:
    st = state_of(ctx)

    async def go() -> Operation:
        async with client(st) as c:
            instance_id = await instance_ref(st, c, instance)
            member_id = await lookup.member(c, instance_id, member)
            return await c.request_operation(instance_id, "remove", member_id=member_id, idempotency_key=new_key())

    emit(st, run(go()), lambda o: out.print(f"Requested remove: {o.status} ({o.operation_id})"))


@app.command("drain")
def drain(
    ctx: typer.Context,
    instance: InstanceRef,
    member: Annotated[str, typer.Argument(metavar="MEMBER", help="Member id or short id, or its allocation's id")],
    deadline: Annotated[
        int | None, typer.Option("--deadline-s", help="How long the controller's drain may take (then it fails)")
    ] = None,
) -> None:
    """Drain a member (planned: the instance is not degraded); a later remove-worker does not drain it again."""
    st = state_of(ctx)

    async def go() -> Operation:
        async with client(st) as c:
            instance_id = await instance_ref(st, c, instance)
            member_id = await lookup.member(c, instance_id, member)
            params = {"deadline_s": deadline} if deadline else {}
            return await c.request_operation(
                instance_id, "drain", member_id=member_id, params=params, idempotency_key=new_key()
            )

    emit(st, run(go()), lambda o: out.print(f"Requested drain: {o.status} ({o.operation_id})"))


@app.command("decommission")
def decommission(
    ctx: typer.Context,
    instance: InstanceRef,
    reason: Annotated[str, typer.Option(help="Why (audited)")] = "decommissioned with the CLI",
    wait: Wait = False,
    timeout: Timeout = 300,
) -> None:
    """Decommission: done only when the controller verified every member's teardown."""
    st = state_of(ctx)

    async def go() -> InstanceDetail:
        async with client(st) as c:
            instance_id = await instance_ref(st, c, instance)
            await c.decommission(instance_id, reason, idempotency_key=new_key())
            if wait:
                return await wait_instance(st, c, instance_id, DECOMMISSION_SETTLED, timeout)
            return await instance_detail(c, instance_id)

    d = run(go())
    emit(st, d, lambda d: out.print(instance_view(d)))
    if wait and d.status != Status.decommissioned:
        raise typer.Exit(1)


@app.command("open")
def open_(
    ctx: typer.Context,
    instance: InstanceRef,
    browser: Annotated[bool, typer.Option(help="Also open it in a browser, when one is available")] = True,
) -> None:
    """Print the browser URL of a launchable app (e.g. JupyterLab) through the gateway, and open it.

    The printed URL needs a sign-in: the browser is handed the URL with this session's access token, which
    the gateway trades for a cookie scoped to the app (the token itself is never printed)."""
    st = state_of(ctx)

    async def go() -> tuple[dict[str, Any], str | None]:
        async with client(st) as c:
            instance_id = await instance_ref(st, c, instance)
            data = plain(await c.instance(instance_id))
            return data, c.token

    data, token = run(go())
    detail: dict[str, Any] = data.get("runtime_detail") or {}
    workload: dict[str, Any] | None = detail.get("workload")
    if not workload:
        err.print(
            f"[red]error:[/red] {data['name']} ({data['app_slug']}) is not a launchable app: nothing to open "
            "in a browser (not_launchable)",
            highlight=False,
        )
        raise typer.Exit(1)
    url = st.url.rstrip("/") + (workload.get("open_path") or f"/apps/{data['instance_id']}/")
    if data["status"] != "running":
        err.print(f"{data['name']} is {data['status']}: the app answers once it is running.", highlight=False)
    opened = False
    if browser and token:
        try:
            opened = webbrowser.get().open(f"{url}?{urlencode({'access_token': token})}")
        except webbrowser.Error:
            opened = False
    opening: dict[str, Any] = {
        "instance_id": data["instance_id"],
        "name": data["name"],
        "status": data["status"],
        "url": url,
        "opened": opened,
    }
    emit(st, opening, lambda d: out.print(d["url"], highlight=False, soft_wrap=True))
