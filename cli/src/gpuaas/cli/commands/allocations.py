"""`gpuaas alloc`: create (`--runtime` picks the runtime image; a create that cannot be placed waits `queued`
unless `--no-queue`), list, show (runtime, driver, limits), runtimes, ssh, restart, resize (a resize up its host
cannot give now waits, shown in list and show), resize-cancel, release (a queued one is cancelled), retry-release;
`--wait` follows the allocation's timeline (a live table on a terminal; a queued allocation's position and reason)
until the change settles. Every ALLOCATION argument is an id, a name or a
unique id prefix (the short id the tables show)."""

from __future__ import annotations

import asyncio
import os
import shlex
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.table import Table

from gpuaas.cli import lookup
from gpuaas.cli.config import remember_host_key
from gpuaas.cli.context import State, client, new_key, project_id, run, state_of
from gpuaas.cli.output import emit, err, out, plain, table
from gpuaas.cli.refs import is_uuid, short_ids
from gpuaas.sdk import Client
from gpuaas.sdk.models import Allocation, AllocationStatus, AllocationTimelineEntry, RuntimeOption, SshHostKey

app = typer.Typer(
    help="Allocations: create, list, show, ssh, restart, resize, resize-cancel, release.", no_args_is_help=True
)

Status = AllocationStatus
SETTLED = {Status.active, Status.failed, Status.released, Status.release_failed}
RUNNING_OR_FAILED = {Status.active, Status.failed}
RELEASED_OR_FAILED = {Status.released, Status.release_failed}

Wait = Annotated[bool, typer.Option("--wait", help="Follow the timeline until the change settles")]
Timeout = Annotated[float, typer.Option(help="Seconds --wait waits at most")]


@dataclass
class AllocationDetail:
    """`alloc show`: the allocation with its timeline."""

    allocation: Allocation
    timeline: list[AllocationTimelineEntry]

    def as_json(self) -> Any:
        return {**plain(self.allocation), "timeline": plain(self.timeline)}


Ref = Annotated[str, typer.Argument(metavar="ALLOCATION", help="Id, name or unique id prefix")]


async def allocation_ref(st: State, c: Client, ref: str) -> str:
    """The allocation `ref` names in the project (a full id is taken as it is)."""
    return ref if is_uuid(ref) else await lookup.allocation(c, await project_id(st, c), ref)


def allocation_rows(items: list[Allocation], shorts: dict[str, str] | None = None) -> Table:
    """One row per allocation; the id column shows the short id the commands accept (unique among `shorts`'
    ids when given, else among `items`)."""
    shorts = shorts or short_ids(a.allocation_id for a in items)
    return table(
        "Allocations",
        ["id", "name", "status", "GPUs", "shape", "SSH", "failure"],
        [
            [
                shorts.get(str(a.allocation_id), str(a.allocation_id)),
                a.name,
                status_line(a),
                f"{a.gpu_count} x {a.gpu_model}",
                a.shape,
                ssh_line(a) or "-",
                a.failure_reason or "",
            ]
            for a in items
        ],
    )


def runtime_line(a: Allocation) -> str:
    """`slug version (digest)`, or why there is none: the process driver runs no image."""
    if a.runtime is None:
        return "none (process driver)" if a.driver == "process" else "-"
    return f"{a.runtime.slug} {a.runtime.version} ({a.runtime.digest})"


def limits_line(a: Allocation) -> str:
    lim = a.limits
    return f"{lim.cpus:g} CPUs, {lim.memory_mb} MB memory, {lim.pids} pids" if lim else "-"


def isolation_rows(a: Allocation) -> Table:
    """What the allocation runs in: the runtime image, the host's driver and the limits."""
    return table(
        "Isolation",
        ["runtime", "driver", "limits"],
        [[runtime_line(a), a.driver or "-", limits_line(a)]],
    )


def status_line(a: Allocation) -> str:
    """The status, and for a queued allocation its place in its project's queue and why it waits (for a running
    one, the resize up that waits)."""
    if a.pending_resize_gpus is not None:
        return f"{a.status} (resize to {a.pending_resize_gpus} GPUs waits: {a.pending_resize_reason or 'waiting'})"
    if a.status != Status.queued:
        return str(a.status)
    where = f"position {a.queue_position}" if a.queue_position else "position pending"
    start = f", starts by {a.estimated_start_at:%H:%M:%S %Z}" if a.estimated_start_at else ""
    return f"queued ({where}, {a.pending_reason or 'waiting'}{start})"


def ssh_line(a: Allocation) -> str | None:
    ep = a.ssh_endpoint
    return f"ssh -p {ep.port} {ep.username}@{ep.host}" if ep else None


async def wait_allocation(
    st: State, c: Client, allocation_id: str, done: set[AllocationStatus], timeout_s: float
) -> Allocation:
    """Follow the timeline (a live table of phases) until the allocation reaches one of `done`."""
    after = 0
    entries: list[AllocationTimelineEntry] = []
    deadline = time.monotonic() + timeout_s

    def view(alloc: Allocation) -> Table:
        return table(
            f"{alloc.name}: {status_line(alloc)}",
            ["phase", "status", "message", "started", "finished"],
            [[e.phase, e.status, e.message, e.started_at, e.finished_at] for e in entries],
        )

    alloc = await c.allocation(allocation_id)
    live = (
        None
        if st.json or (not out.is_terminal and os.environ.get("GPUAAS_PROGRESS") != "1")
        else Live(view(alloc), console=err)
    )
    try:
        if live:
            live.start()
        while True:
            for e in await c.allocation_timeline(allocation_id, after=after):
                after = max(after, e.seq)
                entries.append(e)
                if live is None and not st.json:
                    err.print(f"  {e.phase:<12} {e.status:<10} {e.message}", highlight=False)
            before, alloc = status_line(alloc), await c.allocation(allocation_id)
            if live:
                live.update(view(alloc))
            elif not st.json and status_line(alloc) != before:
                err.print(f"  {status_line(alloc)}", highlight=False)
            if alloc.status in done:
                return alloc
            if time.monotonic() > deadline:
                raise TimeoutError(f"allocation {allocation_id} is still {alloc.status} after {timeout_s:.0f}s")
            await asyncio.sleep(0.5)
    finally:
        if live:
            live.stop()


@app.command("create")
def create(
    ctx: typer.Context,
    name: Annotated[str, typer.Option(help="Allocation name")] = "workspace",
    gpus: Annotated[int | None, typer.Option(help="GPU count (gpu_slice)")] = 1,
    model: Annotated[str, typer.Option(help="GPU model")] = "H100-80GB",
    shape: Annotated[str, typer.Option(help="gpu_slice or baremetal")] = "gpu_slice",
    host_class: Annotated[str | None, typer.Option(help="Pin a host class")] = None,
    volume: Annotated[
        list[str] | None, typer.Option(help="Volume (id, name or short id) to attach; repeatable")
    ] = None,
    runtime: Annotated[
        str | None,
        typer.Option(
            help="Runtime image: slug (newest active version), slug@version or sha256:<digest>; "
            "default: the host class's, else the platform's (see `alloc runtimes`)"
        ),
    ] = None,
    queue: Annotated[
        bool, typer.Option("--queue/--no-queue", help="Wait queued when no capacity is free (else refused: 409)")
    ] = True,
    priority: Annotated[int, typer.Option(min=-100, max=100, help="Order in the project's queue (higher first)")] = 0,
    max_wait: Annotated[int | None, typer.Option(help="Seconds a queued request waits before it fails")] = None,
    wait: Wait = False,
    timeout: Timeout = 300,
) -> None:
    """Create an allocation (with --wait: until it is active or failed, showing its queue position while queued)."""
    st = state_of(ctx)

    async def go() -> Allocation:
        async with client(st) as c:
            pid = await project_id(st, c)
            a = await c.create_allocation(
                pid,
                name=name,
                shape=shape,
                gpu_model=model,
                gpu_count=None if shape == "baremetal" else gpus,
                host_class=host_class,
                volume_ids=[await lookup.volume(c, pid, v) for v in volume or []],
                runtime=runtime,
                idempotency_key=new_key(),
                queue=queue,
                priority=priority,
                max_wait=max_wait,
            )
            if wait:
                a = await wait_allocation(st, c, str(a.allocation_id), SETTLED, timeout)
            return a

    a = run(go())
    emit(st, a, lambda a: out.print(allocation_rows([a])))
    if wait and a.status != Status.active:
        raise typer.Exit(1)


@app.command("list")
def list_(ctx: typer.Context, released: Annotated[bool, typer.Option(help="Include released")] = False) -> None:
    """Allocations of the project."""
    st = state_of(ctx)

    async def go() -> tuple[list[Allocation], dict[str, str]]:
        async with client(st) as c:
            every = await c.allocations(await project_id(st, c), include_released=True)
        # short ids unique among released ones too: the commands resolve against all of them
        shown = every if released else [a for a in every if a.status != Status.released]
        return shown, short_ids(a.allocation_id for a in every)

    items, shorts = run(go())
    emit(st, items, lambda items: out.print(allocation_rows(items, shorts)))


@app.command("show")
def show(ctx: typer.Context, allocation: Ref) -> None:
    """One allocation with its timeline."""
    st = state_of(ctx)

    async def go() -> AllocationDetail:
        async with client(st) as c:
            allocation_id = await allocation_ref(st, c, allocation)
            return AllocationDetail(await c.allocation(allocation_id), await c.allocation_timeline(allocation_id))

    def render(d: AllocationDetail) -> None:
        out.print(allocation_rows([d.allocation]))
        out.print(isolation_rows(d.allocation))
        if d.allocation.after_release:
            out.print(f"After release: {d.allocation.after_release}")
        out.print(
            table(
                "Timeline",
                ["phase", "status", "message", "started"],
                [[e.phase, e.status, e.message, e.started_at] for e in d.timeline],
            )
        )

    emit(st, run(go()), render)


@app.command("runtimes")
def runtimes(ctx: typer.Context) -> None:
    """Runtime images an allocation can be created from (`alloc create --runtime slug[@version]`)."""
    st = state_of(ctx)

    async def go() -> list[RuntimeOption]:
        async with client(st) as c:
            return await c.runtimes(await project_id(st, c))

    def render(items: list[RuntimeOption]) -> None:
        out.print(
            table(
                "Runtimes",
                ["slug", "version", "name", "digest", "state"],
                [[r.slug, r.version, r.display_name, r.digest, r.state] for r in items],
            )
        )

    emit(st, run(go()), render)


@app.command("ssh")
def ssh(
    ctx: typer.Context,
    allocation: Ref,
    identity: Annotated[Path | None, typer.Option("-i", help="Private key file")] = None,
    print_only: Annotated[bool, typer.Option("--print", help="Print the ssh command instead of running it")] = False,
    command: Annotated[list[str] | None, typer.Argument(help="Remote command")] = None,
) -> None:
    """SSH into an allocation (runs OpenSSH's ssh), verifying the host key the platform pinned for it."""
    st = state_of(ctx)

    async def go() -> tuple[Allocation, SshHostKey | None]:
        async with client(st) as c:
            a = await c.allocation(await allocation_ref(st, c, allocation))
            return a, (await c.ssh_host_key(a.allocation_id) if a.ssh_endpoint else None)

    a, pin = run(go())
    ep = a.ssh_endpoint
    if not ep or pin is None:
        err.print(f"[red]error:[/red] allocation is {a.status}: no SSH endpoint yet")
        raise typer.Exit(1)
    known_hosts = remember_host_key(pin.known_hosts)
    argv = ["ssh", "-p", str(ep.port), "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}"]
    if identity:
        argv += ["-i", str(identity)]
    argv += [f"{ep.username}@{ep.host}", *(command or [])]
    if print_only or st.json:
        emit(st, {"argv": argv}, lambda d: out.print(shlex.join(d["argv"])))
        return
    os.execvp("ssh", argv)


def _change(
    ctx: typer.Context,
    allocation: str,
    wait: bool,
    timeout: float,
    done: set[AllocationStatus],
    request: Callable[..., Awaitable[Allocation]],
    *args: Any,
) -> None:
    """One change of an allocation (named by id, name or short id): the client's `request(allocation_id,
    *args)` under a new idempotency key, followed to one of `done` with --wait."""
    st = state_of(ctx)

    async def go() -> Allocation:
        async with client(st) as c:
            allocation_id = await allocation_ref(st, c, allocation)
            a = await request(c, allocation_id, *args, idempotency_key=new_key())
            if wait:
                a = await wait_allocation(st, c, allocation_id, done, timeout)
            return a

    a = run(go())
    emit(st, a, lambda a: out.print(allocation_rows([a])))
    if wait and a.status in {Status.failed, Status.release_failed}:
        raise typer.Exit(1)


@app.command("restart")
def restart(ctx: typer.Context, allocation: Ref, wait: Wait = False, timeout: Timeout = 300) -> None:
    """Restart in place (same id, host, endpoint, keys and volumes)."""
    _change(ctx, allocation, wait, timeout, RUNNING_OR_FAILED, Client.restart_allocation)


@app.command("resize")
def resize(
    ctx: typer.Context,
    allocation: Ref,
    gpus: int,
    queue: Annotated[
        bool, typer.Option("--queue/--no-queue", help="Wait for GPUs when the host has none free (else refused: 409)")
    ] = True,
    wait: Wait = False,
    timeout: Timeout = 300,
) -> None:
    """Change the GPU count of a gpu_slice allocation. A resize up its host cannot give now waits (the allocation
    runs on; `alloc show` says what it waits for) until granted or cancelled with `alloc resize-cancel`."""
    _change(ctx, allocation, wait, timeout, RUNNING_OR_FAILED, partial(Client.resize_allocation, queue=queue), gpus)


@app.command("resize-cancel")
def resize_cancel(ctx: typer.Context, allocation: Ref) -> None:
    """Cancel a resize that waits for GPUs (nothing was reserved for it); the allocation keeps its GPUs."""
    _change(ctx, allocation, False, 0, RUNNING_OR_FAILED, Client.cancel_resize)


@app.command("release")
def release(ctx: typer.Context, allocation: Ref, wait: Wait = False, timeout: Timeout = 300) -> None:
    """Release (billing stops at the request)."""
    _change(ctx, allocation, wait, timeout, RELEASED_OR_FAILED, Client.release_allocation)


@app.command("retry-release")
def retry_release(ctx: typer.Context, allocation: Ref, wait: Wait = False, timeout: Timeout = 300) -> None:
    """Retry a release that failed."""
    _change(ctx, allocation, wait, timeout, RELEASED_OR_FAILED, Client.retry_release_allocation)
