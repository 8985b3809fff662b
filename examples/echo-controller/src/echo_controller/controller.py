"""Echo: a `server` member runs an HTTP server answering the instance's `greeting`; each `worker` member runs
a process that polls it and keeps the last answer. Both are real processes started over SSH in the member's
allocation with the instance credential. Where the server listens is kept in the controller state on the
platform, so workers (and other replicas of this controller) find it.

The manifest says `worker` comes `after` `server`: the platform hands out workers' adds only once the server
is up, and on decommission removes the workers before the server. A worker's remove drains it first (its
poller stops) through the `drain` handler.

Every handler is idempotent: it looks at what runs before it starts anything, so a retried operation (lease
lost, process killed) converges.
"""

from __future__ import annotations

import json
import shlex
from importlib.resources import files
from typing import Any

from gpuaas.sdk.controller import (
    Controller,
    OperationContext,
    PermanentError,
    ReconcileContext,
    TemporaryError,
    on,
)
from gpuaas.sdk.controller.exec import member_address

MANIFEST: dict[str, Any] = json.loads(files("echo_controller").joinpath("manifest.json").read_text())

# Each member's files live in ~/echo/<member id>/ of its allocation: pid, port, and what the process writes.
START_SERVER = r"""
set -eu; d=~/echo/$MEMBER; mkdir -p "$d"
if [ -f "$d/pid" ] && kill -0 "$(cat "$d/pid")" 2>/dev/null; then echo "PORT=$(cat "$d/port")"; exit 0; fi
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("0.0.0.0", 0)); print(s.getsockname()[1])')
printf '%s' "$GREETING" > "$d/index.html"
setsid nohup python3 -m http.server "$port" --bind 0.0.0.0 --directory "$d" >"$d/log" 2>&1 </dev/null &
echo $! > "$d/pid"; echo "$port" > "$d/port"
for _ in $(seq 50); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/index.html', timeout=1)" 2>/dev/null \
    && { echo "PORT=$port"; exit 0; }; sleep 0.2
done
echo "server did not answer on $port: $(tail -n 3 "$d/log")" >&2; exit 1
"""
START_WORKER = r"""
set -eu; d=~/echo/$MEMBER; mkdir -p "$d"
if ! { [ -f "$d/pid" ] && kill -0 "$(cat "$d/pid")" 2>/dev/null; }; then
  setsid nohup sh -c "while :; do python3 -c \"import urllib.request as u; \
print(u.urlopen('$URL', timeout=2).read().decode())\" > '$d/last.tmp' 2>>'$d/log' && mv '$d/last.tmp' '$d/last'; \
sleep $EVERY; done" >/dev/null 2>&1 </dev/null &
  echo $! > "$d/pid"
fi
for _ in $(seq 50); do [ -s "$d/last" ] && { echo "PID=$(cat "$d/pid")"; exit 0; }; sleep 0.2; done
echo "worker got no answer from $URL" >&2; exit 1
"""
# Stop the member's process (its whole session), keep its files (a drained worker: its last answer stays).
STOP = r"""
d=~/echo/$MEMBER; pid=$(cat "$d/pid" 2>/dev/null || true)
[ -n "$pid" ] && { kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true; }
for _ in $(seq 25); do [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && sleep 0.2 || break; done
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "process $pid still running"; exit 1; fi
echo "stopped ${pid:-none}"
"""
# Stop the member's process (its whole session), remove its files, then CHECK both are gone.
TEARDOWN = r"""
d=~/echo/$MEMBER; pid=$(cat "$d/pid" 2>/dev/null || true)
[ -n "$pid" ] && { kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true; }
for _ in $(seq 25); do [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && sleep 0.2 || break; done
[ -n "$pid" ] && kill -KILL -- "-$pid" 2>/dev/null || true
rm -rf "$d"
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "process $pid still running"; exit 1; fi
[ -e "$d" ] && { echo "$d still exists"; exit 1; }
echo "process ${pid:-none} gone, $d removed"
"""
ALIVE = r"""d=~/echo/$MEMBER; kill -0 "$(cat "$d/pid" 2>/dev/null || echo 0)" 2>/dev/null && echo alive || echo dead"""


def env(script: str, **values: Any) -> str:
    """The script with its variables set first (quoted for sh)."""
    return "".join(f"{k}={shlex.quote(str(v))}\n" for k, v in values.items()) + script


class EchoController(Controller):
    config_schema = MANIFEST["inputs"]
    reconcile_every_s = 10.0

    @on("add", role="server")
    async def add_server(self, ctx: OperationContext) -> dict[str, Any]:
        op, config = ctx.operation, await ctx.config()
        await ctx.progress("starting the echo server", 20)
        out = await ctx.shell().run(
            "sh -s", input=env(START_SERVER, MEMBER=op.target_member_id, GREETING=config.greeting)
        )
        port = int(out.stdout.split("PORT=")[1].split()[0])
        if op.allocation_id is None:  # an add names the allocation the member runs on
            raise PermanentError("this operation names no allocation")
        host = await member_address(ctx.client, op.allocation_id)  # reachable from the other members
        state = await ctx.state()
        await state.update(
            lambda d: d.update(
                server={"member_id": str(op.target_member_id), "url": f"http://{host}:{port}/index.html"}
            )
        )
        await ctx.event("server_up", f"echo server on {host}:{port}")
        ctx.member_detail.update(port=port, host=host)
        return {"role": "server", "url": f"http://{host}:{port}/"}

    @on("add", role="worker")
    async def add_worker(self, ctx: OperationContext) -> dict[str, Any]:
        op, config = ctx.operation, await ctx.config()
        server = (await ctx.state()).data.get("server")
        if server is None:  # no server (say it was removed and is being added again): not a failure, and no
            ctx.defer("no echo server yet")  # reason to hold the lease; offered again when the instance changes
        await ctx.progress(f"starting a worker polling {server['url']}", 30)
        script = env(START_WORKER, MEMBER=op.target_member_id, URL=server["url"], EVERY=config.poll_every_s)
        out = await ctx.shell().run("sh -s", input=script)
        pid = int(out.stdout.split("PID=")[1].split()[0])
        ctx.member_detail.update(pid=pid, polls=server["url"])
        await ctx.event("worker_joined", f"worker {op.target_member_id} polls {server['url']}")
        return {"role": "worker", "pid": pid}

    @on("drain", role="worker")
    async def drain_worker(self, ctx: OperationContext) -> dict[str, Any]:
        """The worker stops polling (a planned drain: the instance stays running); its remove then finds it
        stopped. A `remove` runs this first (no drain handler for the server: it is removed directly)."""
        out = await ctx.shell().run("sh -s", input=env(STOP, MEMBER=ctx.operation.member_id), check=False)
        if out.exit_status != 0:
            raise TemporaryError(out.stdout.strip() or "worker still running", delay=1)
        return {"drained": True}

    @on("remove")
    async def remove(self, ctx: OperationContext) -> dict[str, Any]:
        op = ctx.operation
        out = await ctx.shell().run("sh -s", input=env(TEARDOWN, MEMBER=op.member_id), check=False)
        verified = out.exit_status == 0
        if op.component_key == "server" and verified:
            await (await ctx.state()).update(lambda d: d.pop("server", None))
        return {"teardown_verified": verified, "evidence": (out.stdout + out.stderr).strip()}

    async def reconcile(self, ctx: ReconcileContext) -> None:
        inst = ctx.instance_snapshot
        if inst.desired_app_version:  # nothing to roll out between versions of this app: confirm it
            await ctx.report(app_version=inst.desired_app_version)
        if inst.status not in ("running", "degraded"):
            return
        members = [m for m in await ctx.members() if m.status == "active"]
        dead = []
        for m in members:
            out = await ctx.shell(m.allocation_id, wait_s=20).run("sh -s", input=env(ALIVE, MEMBER=m.member_id))
            if out.stdout.strip() != "alive":
                dead.append(m)
                await ctx.client.report_member(m.member_id, status="failed", detail={"reason": "process not running"})
        server = (await ctx.state()).data.get("server") or {}
        workers = sum(1 for m in members if m.component_key == "worker" and m not in dead)
        health = {
            "status": "degraded" if dead else "healthy",
            "message": f"{workers} worker(s) polling; {len(dead)} dead",
        }
        await ctx.report(health=health, runtime_detail={"url": server.get("url"), "workers": workers})
