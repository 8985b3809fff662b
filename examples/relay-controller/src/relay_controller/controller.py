"""Relay: a `head` member keeps a roster of the workers registered with it; each `worker` member runs a process
and is registered in the head's roster (the controller writes the registration on the head's allocation, as a
worker's join call would). The order matters both ways, and the manifest says so (`worker` comes `after`
`head`): a worker cannot register before the head is up, and the head cannot be torn down cleanly while workers
are still registered. So the platform hands out workers' adds once the head is up, and on decommission removes
the workers (each drained first: deregistered, stopped) before the head, whose teardown checks the roster is
empty.

Every handler is idempotent: a retried operation (lease lost, process killed) converges.
"""

from __future__ import annotations

import json
import shlex
from importlib.resources import files
from typing import Any

from gpuaas.sdk.controller import Controller, OperationContext, ReconcileContext, TemporaryError, on

MANIFEST: dict[str, Any] = json.loads(files("relay_controller").joinpath("manifest.json").read_text())

# Each script starts with `# relay:<step>` (what it does, for people and for the unit tests' fake host).
HEAD_START = r"""# relay:head_start
set -eu; d=~/relay/head; mkdir -p "$d/workers"
if ! { [ -f "$d/pid" ] && kill -0 "$(cat "$d/pid")" 2>/dev/null; }; then
  setsid nohup sh -c "while :; do ls '$d/workers' > '$d/roster.tmp' && mv '$d/roster.tmp' '$d/roster'; sleep 1; done" \
    >/dev/null 2>&1 </dev/null &
  echo $! > "$d/pid"
fi
echo "PID=$(cat "$d/pid")"
"""
WORKER_START = r"""# relay:worker_start
set -eu; d=~/relay/$MEMBER; mkdir -p "$d"
if ! { [ -f "$d/pid" ] && kill -0 "$(cat "$d/pid")" 2>/dev/null; }; then
  setsid nohup sh -c "while :; do date +%s > '$d/beat'; sleep 1; done" >/dev/null 2>&1 </dev/null &
  echo $! > "$d/pid"
fi
echo "PID=$(cat "$d/pid")"
"""
REGISTER = r"""# relay:register
set -eu; [ -d ~/relay/head/workers ] || { echo "no head here" >&2; exit 1; }
touch ~/relay/head/workers/"$MEMBER"; echo registered
"""
DEREGISTER = r"""# relay:deregister
set -eu; rm -f ~/relay/head/workers/"$MEMBER"; echo deregistered
"""
# Stop the member's process, remove its files, then CHECK; the head also checks that nobody is registered.
TEARDOWN = r"""# relay:teardown
d=~/relay/$NAME
if [ "$NAME" = head ] && [ -n "$(ls "$d/workers" 2>/dev/null)" ]; then
  echo "workers still registered: $(ls "$d/workers" | tr '\n' ' ')"; exit 1
fi
pid=$(cat "$d/pid" 2>/dev/null || true)
[ -n "$pid" ] && { kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true; }
for _ in $(seq 25); do [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && sleep 0.2 || break; done
rm -rf "$d"
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then echo "process $pid still running"; exit 1; fi
[ -e "$d" ] && { echo "$d still exists"; exit 1; }
echo "process ${pid:-none} gone, $d removed"
"""
ROSTER = r"""# relay:roster
ls ~/relay/head/workers 2>/dev/null || true
"""


def env(script: str, **values: Any) -> str:
    """The script with its variables set first (quoted for sh), after its `# relay:` line."""
    head, _, body = script.partition("\n")
    return head + "\n" + "".join(f"{k}={shlex.quote(str(v))}\n" for k, v in values.items()) + body


class RelayController(Controller):
    config_schema = MANIFEST["inputs"]
    reconcile_every_s = 15.0

    async def _head(self, ctx: OperationContext | ReconcileContext) -> dict[str, str] | None:
        head: dict[str, str] | None = (await ctx.state()).data.get("head")
        return head

    @on("add", role="head")
    async def add_head(self, ctx: OperationContext) -> dict[str, Any]:
        op = ctx.operation
        out = await ctx.shell().run("sh -s", input=HEAD_START)
        await (await ctx.state()).update(
            lambda d: d.update(head={"member_id": str(op.target_member_id), "allocation_id": str(op.allocation_id)})
        )
        ctx.member_detail.update(pid=int(out.stdout.split("PID=")[1].split()[0]))
        return {"role": "head"}

    @on("add", role="worker")
    async def add_worker(self, ctx: OperationContext) -> dict[str, Any]:
        head = await self._head(ctx)
        if head is None:  # the platform brings workers up after the head; a head being replaced: wait for it
            ctx.defer("no head to register with yet")
        member = ctx.operation.target_member_id
        out = await ctx.shell().run("sh -s", input=env(WORKER_START, MEMBER=member))
        await ctx.shell(head["allocation_id"]).run("sh -s", input=env(REGISTER, MEMBER=member))
        ctx.member_detail.update(pid=int(out.stdout.split("PID=")[1].split()[0]), head=head["member_id"])
        await ctx.event("worker_registered", f"worker {member} registered with the head")
        return {"role": "worker", "registered": True}

    @on("drain", role="worker")
    async def drain_worker(self, ctx: OperationContext) -> dict[str, Any]:
        """Leave the head's roster, then stop. A `remove` runs this first (within the operation's deadline)."""
        member = ctx.operation.member_id
        head = await self._head(ctx)
        if head is not None:
            out = await ctx.shell(head["allocation_id"]).run("sh -s", input=env(DEREGISTER, MEMBER=member), check=False)
            if out.exit_status != 0:
                raise TemporaryError(f"could not deregister from the head: {out.stdout}{out.stderr}", delay=1)
        await ctx.event("worker_left", f"worker {member} left the head's roster")
        return {"deregistered": head is not None}

    @on("remove")
    async def remove(self, ctx: OperationContext) -> dict[str, Any]:
        op = ctx.operation
        name = "head" if op.component_key == "head" else str(op.member_id)
        out = await ctx.shell().run("sh -s", input=env(TEARDOWN, NAME=name), check=False)
        verified = out.exit_status == 0
        if op.component_key == "head" and verified:
            await (await ctx.state()).update(lambda d: d.pop("head", None))
        return {"teardown_verified": verified, "evidence": (out.stdout + out.stderr).strip()}

    async def reconcile(self, ctx: ReconcileContext) -> None:
        inst = ctx.instance_snapshot
        if inst.desired_app_version:
            await ctx.report(app_version=inst.desired_app_version)
        head = await self._head(ctx)
        if inst.status not in ("running", "degraded") or head is None:
            return
        out = await ctx.shell(head["allocation_id"], wait_s=20).run("sh -s", input=ROSTER, check=False)
        roster = sorted(out.stdout.split())
        workers = [m for m in await ctx.members() if m.component_key == "worker" and m.status == "active"]
        missing = [str(m.member_id) for m in workers if str(m.member_id) not in roster]
        health = {
            "status": "degraded" if missing else "healthy",
            "message": f"{len(roster)} worker(s) registered" + (f"; {len(missing)} missing" if missing else ""),
        }
        await ctx.report(health=health, runtime_detail={"roster": roster})
