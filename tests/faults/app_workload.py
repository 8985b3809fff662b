"""App runtime's busiest flow: member operations of a clustered app instance, claimed, heartbeated and
completed by a controller while users keep asking for more.

Over the allocations of a `workload.Saga` (a host full of them, active): an app (its manifest and the
tenant's entitlement put on catalog's topic through catalog's outbox, as tests/e2e does) is deployed
split over two allocations; a project service account bound as its controller runs `Adapter` in
`gpuaas.sdk.ReconcileLoop` in this process (claim with a lease, heartbeats while the work runs, complete).
Then users ask for worker adds and removes (through the gateway, retried through the fault with the same
Idempotency-Key), one operation is claimed by a "doomed" replica that never reports (its lease must expire
and the live controller must redo it), and a remove is asked for as soon as one of the adds has succeeded.
Afterwards the instance is decommissioned (verified teardown of every member) and the allocations are
released, so the saga's own invariants run too.

Invariants (`check_operations`): every operation succeeded exactly once (one `succeeded` event, one
timeline entry, one audit record in identity; the controller reported it at most once), the doomed claim
was taken over after its lease expired, no operation was created twice, the live members are exactly what
the succeeded operations leave, the instance's timeline has no entry twice, every outbox row was sent, and
nothing is parked in any service's dead letters.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from gpuaas.contracts.events import catalog as cat
from gpuaas.devstack.stack import SERVICES, Stack
from gpuaas.devstack.waiting import eventually
from gpuaas.kit.db import create_engine, session_factory
from gpuaas.kit.outbox import add_events
from gpuaas.sdk import Client, Controller, OperationContext, ReconcileLoop

from .workload import Saga, call, response_lost

AR = "/api/app-runtime"
LEASE_S = 6  # the SDK heartbeats every LEASE_S / 3 s
WORK_S = 2.5  # each operation's work: at least one heartbeat lands meanwhile
# What a deploy meets while app-runtime's projections of catalog, allocations and identity catch up.
CATCHING_UP = ("app_not_found", "app_not_entitled", "project_not_found", "not_found")
CATCHING_UP += ("allocation_not_in_project", "allocation_not_active")


class Adapter(Controller):
    """Idempotent no-op work that takes WORK_S; counts how often each operation was handled."""

    def __init__(self) -> None:
        self.handled: dict[uuid.UUID, int] = {}

    async def _work(self, ctx: OperationContext) -> None:
        op = ctx.operation.operation_id
        self.handled[op] = self.handled.get(op, 0) + 1
        await asyncio.sleep(WORK_S)

    async def add(self, ctx: OperationContext) -> dict[str, Any]:
        await self._work(ctx)
        return {"node": f"{ctx.operation.component_key}@{ctx.operation.allocation_id}"}

    recover = add
    replace = add

    async def drain(self, ctx: OperationContext) -> dict[str, Any]:
        await self._work(ctx)
        return {"drained": True}

    async def remove(self, ctx: OperationContext) -> dict[str, Any]:
        await self._work(ctx)
        return {"teardown_verified": True, "evidence": "fault test: nothing was running"}


@dataclass
class Controllers:
    """The controller replica of the test, supervised as a process manager would: a loop that dies of a
    network error is started again (and counted)."""

    client: Client
    slug: str
    adapter: Adapter = field(default_factory=Adapter)
    loop: ReconcileLoop | None = None
    task: asyncio.Task[None] | None = None
    restarts: int = 0

    def start(self) -> None:
        self.loop = ReconcileLoop(
            self.client,
            app_slug=self.slug,
            controller=self.adapter,
            lease_s=LEASE_S,
            poll_interval_s=0.3,
            holder="replica-a",
        )
        self.task = asyncio.create_task(self._supervise(self.loop))

    async def _supervise(self, loop: ReconcileLoop) -> None:
        while True:
            try:
                await loop.run()
                return
            except httpx.HTTPError:
                self.restarts += 1
                await asyncio.sleep(0.5)

    async def stop(self) -> None:
        if self.loop is not None and self.task is not None:
            self.loop.stop()
            await asyncio.wait_for(self.task, 30)


@dataclass
class AppOps:
    saga: Saga
    slug: str = ""
    sa: dict[str, Any] = field(default_factory=dict)
    ctl: Controllers | None = None
    instance_id: str = ""
    requested: dict[str, str] = field(default_factory=dict)  # operation id -> what it is
    doomed: str = ""
    retries: dict[str, int] = field(default_factory=dict)
    reran: int = 0

    @property
    def stack(self) -> Stack:
        return self.saga.stack

    @property
    def user(self) -> httpx.AsyncClient:
        return self.saga.client

    @property
    def controllers(self) -> Controllers:
        assert self.ctl is not None
        return self.ctl

    async def setup(self) -> None:
        saga = self.saga
        await saga.create_until_full()
        await saga.wait_all("active", timeout_s=240)
        self.slug = f"fa-{saga.run}"
        r = await call(
            saga.gw,
            "POST",
            f"/api/identity/projects/{saga.project}/service-accounts",
            json={"name": f"ctl-{saga.run}", "scopes": ["app-controller"]},
            ok=(201,),
        )
        self.sa = r.json()
        manifest = cat.AppManifestState(
            manifest_id=uuid.uuid4(),
            slug=self.slug,
            display_name="Fault cluster",
            version="1.0.0",
            artifact_kind=cat.AppArtifactKind.controller,
            artifact_ref="registry.local/apps/faults@sha256:" + "f" * 64,
            compatibility=cat.Compatibility(multi_allocation=True),
            roles=[cat.AppRole(key="head"), cat.AppRole(key="worker")],
            active=True,
            revision=1,
        )
        entitlement = cat.EntitlementState(
            entitlement_id=uuid.uuid4(),
            tenant_id=uuid.UUID(saga.tenant),
            app_slug=self.slug,
            granted_at=datetime.now(UTC),
            version=1,
        )
        engine = create_engine(self.stack.database_url("catalog"), "catalog", pool_size=1)
        try:
            async with session_factory(engine)() as s, s.begin():
                await add_events(
                    s,
                    [
                        cat.AppRegistered.build(data=manifest, source="catalog"),
                        cat.EntitlementGranted.build(data=entitlement, source="catalog"),
                    ],
                )
        finally:
            await engine.dispose()
        client = Client(self.stack.gateway_url)
        client.use_client_credentials(self.sa["client_id"], self.sa["client_secret"])
        self.ctl = Controllers(client, self.slug)

    async def close(self) -> None:
        if self.ctl is not None:
            await self.ctl.stop()
            await self.ctl.client.aclose()

    # ------------------------------------------------------------------------------------------ steps

    async def deploy(self) -> None:
        a = self.saga.allocations
        body = {
            "name": "cluster",
            "app_slug": self.slug,
            "config": {},
            "placement_intent": {"mode": "split", "controller_allocation_id": a[0], "worker_allocation_ids": [a[1]]},
        }

        async def accepted() -> str | None:  # app-runtime's projections catch up with catalog and allocations
            r = await self.user.post(f"{AR}/projects/{self.saga.project}/instances", json=body)
            if r.status_code == 201:
                return str(r.json()["instance_id"])
            assert r.status_code in (404, 409, 422) and r.json()["code"] in CATCHING_UP, r.text
            return None

        self.instance_id = await eventually(accepted, 90, "the deploy accepted")

        async def bound() -> bool:
            r = await self.user.put(
                f"{AR}/projects/{self.saga.project}/controllers/{self.slug}",
                json={"service_account_id": self.sa["service_account_id"]},
            )
            assert r.status_code == 200 or r.json()["code"] == "service_account_invalid", r.text
            return r.status_code == 200

        await eventually(bound, 60, "the controller bound")
        self.controllers.start()
        await self.wait_instance("running")

    async def instance(self) -> dict[str, Any]:
        r = await call(self.user, "GET", f"{AR}/instances/{self.instance_id}", ok=(200,), stats=self.retries)
        return r.json()

    async def wait_instance(self, *wanted: str, timeout_s: float = 120) -> None:
        async def there() -> bool:
            return (await self.instance())["status"] in wanted

        await eventually(there, timeout_s, f"the instance {'/'.join(wanted)}", interval_s=0.5)

    async def members(self, tombstones: bool = False) -> list[dict[str, Any]]:
        r = await call(
            self.user,
            "GET",
            f"{AR}/instances/{self.instance_id}/members",
            params={"include_tombstones": str(tombstones).lower()},
            ok=(200,),
            stats=self.retries,
        )
        return r.json()["items"]

    async def operations(self) -> dict[str, dict[str, Any]]:
        r = await call(self.user, "GET", f"{AR}/instances/{self.instance_id}/operations", ok=(200,), stats=self.retries)
        return {o["operation_id"]: o for o in r.json()["items"]}

    async def request(self, what: str, kind: str, **target: str) -> str:
        """Ask for an operation. A remove whose first run committed but whose response died with the process
        runs again once its Idempotency-Key reservation is stale, and is refused (the member is busy or gone):
        then, as a client would, find the operation the first run created (counted in `reran`)."""
        stats: dict[str, int] = {}
        r = await call(
            self.user,
            "POST",
            f"{AR}/instances/{self.instance_id}/operations",
            json={"kind": kind, **target},
            ok=(201, 409),
            stats=stats,
        )
        for k, v in stats.items():
            self.retries[k] = self.retries.get(k, 0) + v
        if r.status_code == 201:
            op = str(r.json()["operation_id"])
        else:
            code = r.json().get("code")
            rerun_refused = bool(stats) and kind == "remove" and code in ("operation_in_flight", "member_tombstoned")
            assert rerun_refused or response_lost(r), r.text
            ops = await self.operations()
            found = [
                o
                for o, v in ops.items()
                if o not in self.requested and v["kind"] == kind and all(v.get(k) == t for k, t in target.items())
            ]
            assert len(found) == 1, found
            op = found[0]
            self.reran += 1
        self.requested[op] = what
        return op

    async def member_on(self, allocation_id: str, key: str = "worker") -> str:
        found = [m for m in await self.members() if m["allocation_id"] == allocation_id and m["component_key"] == key]
        assert len(found) == 1, found
        return str(found[0]["member_id"])

    async def start_batch(self) -> dict[str, str]:
        """With the controller paused: three adds and a remove asked for, and the remove claimed by a replica
        that will never report. Returns the operation ids by name."""
        await self.controllers.stop()
        a = self.saga.allocations
        w1 = await self.member_on(a[1])
        ops = {
            "add worker a2": await self.request("add worker a2", "add", allocation_id=a[2]),
            "add worker a3": await self.request("add worker a3", "add", allocation_id=a[3]),
            "add worker a0": await self.request("add worker a0", "add", allocation_id=a[0]),
            "remove worker a1": await self.request("remove worker a1", "remove", member_id=w1),
        }
        self.doomed = ops["remove worker a1"]
        claim = await self.controllers.client.claim(self.slug, operation_id=self.doomed, lease_s=5, holder="doomed")
        assert claim is not None
        self.controllers.start()
        return ops

    async def succeeded(self, op: str) -> bool:
        return (await self.operations())[op]["status"] == "succeeded"

    async def remove_when_added(self, add_op: str, allocation_id: str) -> str:
        await eventually(lambda: self.succeeded(add_op), 180, f"{self.requested[add_op]} succeeded")
        member = await self.member_on(allocation_id)
        return await self.request(f"remove worker {allocation_id[-4:]}", "remove", member_id=member)

    async def wait_all_succeeded(self, timeout_s: float = 240) -> None:
        async def done() -> bool:
            ops = await self.operations()
            failed = {o: ops[o]["error"] for o in self.requested if ops[o]["status"] in ("failed", "cancelled")}
            assert not failed, failed
            return all(ops[o]["status"] == "succeeded" for o in self.requested)

        await eventually(done, timeout_s, "every requested operation succeeded", interval_s=0.5)

    async def decommission(self) -> None:
        await call(
            self.user,
            "POST",
            f"{AR}/instances/{self.instance_id}/decommission",
            json={"reason": "fault test done"},
            ok=(200,),
            stats=self.retries,
        )
        await self.wait_instance("decommissioned", "decommission_failed", timeout_s=180)
        assert (await self.instance())["status"] == "decommissioned"


# -------------------------------------------------------------------------------------------- invariants


async def check_operations(w: AppOps, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run before decommissioning: the instance with the outcome of every requested operation."""
    stack = w.stack
    inst = await w.instance()
    assert inst["status"] == "running", inst
    ops = await w.operations()
    requested = list(w.requested)
    assert all(ops[o]["status"] == "succeeded" for o in requested), {w.requested[o]: ops[o] for o in requested}

    # Nothing created twice: the instance holds the deploy's two adds and exactly what was asked for.
    assert len(ops) == 2 + len(requested), sorted((o["kind"], o["allocation_id"], o["status"]) for o in ops.values())

    # The doomed claim expired and the live replica redid the operation.
    doomed = ops[w.doomed]
    assert doomed["attempt"] >= 2 and "replica-a" in (doomed["claimed_by"] or ""), doomed

    # Each operation succeeded once: one event, one audit record in identity, reported once by the controller.
    ids = list(ops)
    succeeded = await stack.fetch(
        "app_runtime",
        "SELECT aggregate_id, count(*) AS n FROM outbox WHERE aggregate_id = ANY($1) "
        "AND event_type = 'member_operation.succeeded' GROUP BY aggregate_id",
        ids,
    )
    assert len(succeeded) == len(ids) and all(r["n"] == 1 for r in succeeded), [dict(r) for r in succeeded]
    reported = [str(o.operation_id) for o in (w.controllers.loop.handled if w.controllers.loop else [])]
    assert all(reported.count(o) <= 1 for o in ids), reported

    async def audited() -> list[Any]:
        rows = await stack.fetch(
            "identity",
            "SELECT resource_id, count(*) AS n FROM audit_records WHERE action = 'apps.operation.complete' "
            "AND resource_id = ANY($1) GROUP BY resource_id",
            ids,
        )
        return rows if len(rows) == len(ids) else []

    rows = await eventually(audited, timeout_s, "identity's audit record of each completed operation")
    assert all(r["n"] == 1 for r in rows), [dict(r) for r in rows]

    # Members are what the succeeded operations leave: every add's member, less the removed ones.
    added = {o["result_member_id"] for o in ops.values() if o["kind"] == "add"}
    removed = {o["member_id"] for o in ops.values() if o["kind"] == "remove"}
    live = await w.members()
    assert {m["member_id"] for m in live} == added - removed, (live, added, removed)
    assert all(m["status"] == "active" for m in live), live
    tombs = [m for m in await w.members(tombstones=True) if m["member_id"] in removed]
    assert len(tombs) == len(removed) and all(m["tombstoned"] and m["status"] == "removed" for m in tombs), tombs

    # The timeline: no entry twice; per operation one created and one succeeded, a claim per attempt.
    entries = await stack.fetch(
        "app_runtime",
        "SELECT kind, message, data::text AS data FROM instance_events WHERE instance_id = $1 ORDER BY seq",
        uuid.UUID(w.instance_id),
    )
    seen: dict[tuple[str, str, str], int] = {}
    for e in entries:
        if e["kind"] in ("member.starting", "member.stopping"):  # repeated, rightly, when a lease is taken over
            continue
        key = (e["kind"], e["message"], e["data"])
        seen[key] = seen.get(key, 0) + 1
    assert all(n == 1 for n in seen.values()), [k for k, n in seen.items() if n > 1]
    for op in ops.values():
        mine = [e["kind"] for e in entries if json.loads(e["data"]).get("operation_id") == op["operation_id"]]
        assert (mine.count("operation.created"), mine.count("operation.succeeded")) == (1, 1), (op, mine)
        assert mine.count("operation.claimed") == op["attempt"], (op, mine)
    for member in added:
        mine = [e["kind"] for e in entries if json.loads(e["data"]).get("member_id") == member]
        assert (mine.count("member.added"), mine.count("member.active")) == (1, 1), (member, mine)

    async def all_sent() -> bool:
        return await stack.fetchval("app_runtime", "SELECT count(*) FROM outbox WHERE sent_at IS NULL") == 0

    await eventually(all_sent, timeout_s, "app-runtime's outbox rows all sent")
    parked = {
        svc: await stack.fetchval(svc, "SELECT count(*) FROM dead_letters WHERE status = 'parked'") for svc in SERVICES
    }
    assert not any(parked.values()), parked
    attempts = sorted(o["attempt"] for o in ops.values())
    return {
        "operations": len(ops),
        "attempts": attempts,
        "handled_by_controller": sum(w.controllers.adapter.handled.values()),
        "controller_restarts": w.controllers.restarts,
        "timeline_entries": len(entries),
        "retried": dict(w.retries),
        "reran": w.reran,
    }
