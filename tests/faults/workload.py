"""The saga every fault test drives through the gateway, and the invariants checked after it.

Saga: a tenant + project + member (identity) → a price (billing) → a host enrolled and its node-agent
registered (allocations) → allocations created concurrently until the host is full, one more refused
(placement) → provision tasks run by the agent → active (metering opens meters) → release → agent
release tasks → released (metering closes meters and emits final usage) → billing rates the usage into
the ledger. Every step goes through the public API; requests that meet the fault (502/503/504 or a
dropped connection) are retried with the same Idempotency-Key, as a client would.

Invariants (`check_invariants`): every allocation reached its final state; no GPU was booked twice (on
the host at any moment, and in the final assignments); every allocation has exactly one meter, closed,
and exactly one final usage record; every usage record is received, rated and charged exactly once by
billing; the ledger balances; identity stored each allocation's audit record exactly once; nothing is
parked in any service's dead letters.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import httpx

from gpuaas.devstack.stack import SERVICES, Stack
from gpuaas.devstack.waiting import eventually

GPUS_PER_HOST = 8
GPUS_PER_ALLOCATION = 2
RETRYABLE = {502, 503, 504}


class ServerError(AssertionError):
    """A 500 (or any unexpected status): a bug, never retried."""


async def call(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    ok: tuple[int, ...],
    json: Any = None,
    data: Any = None,
    params: Any = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 180.0,
    stats: dict[str, int] | None = None,
) -> httpx.Response:
    """One logical request, retried through a fault with the same Idempotency-Key (and the same `headers`)."""
    headers = {**(headers or {}), **({"Idempotency-Key": str(uuid.uuid4())} if method == "POST" else {})}
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            r = await client.request(method, url, json=json, data=data, params=params, headers=headers)
            if (r.status_code in ok and not _in_progress(r)) or response_lost(r):
                return r
            if r.status_code not in RETRYABLE and not _in_progress(r):
                raise ServerError(f"{method} {url} -> {r.status_code} {r.text[:500]}")
            what = f"HTTP {r.status_code}"
        except httpx.TransportError as exc:
            what = type(exc).__name__
        if stats is not None:
            stats[what] = stats.get(what, 0) + 1
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{method} {url}: still failing ({what}) after {timeout_s}s")
        await asyncio.sleep(0.5)


def response_lost(r: httpx.Response) -> bool:
    """409 for a key whose first request committed its effect but died before answering (never re-run):
    the caller reads the resource instead, as a client would."""
    return r.status_code == 409 and "idempotency_request_committed" in r.text


def _in_progress(r: httpx.Response) -> bool:
    """409 for a key whose first request is still running (or died mid-request): retry later."""
    return r.status_code == 409 and "idempotency_request_in_progress" in r.text


class Agent:
    """A node-agent process for one host (it dials out to allocations)."""

    def __init__(self, stack: Stack, name: str, token: str) -> None:
        self.stack, self.name, self.token = stack, name, token
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = self.stack.agent_env(self.name, self.token, f"{GPUS_PER_HOST}xH100-80GB", GPUAAS_AGENT_LONG_POLL_S="5")
        with open(self.stack.logs_dir / f"agent-{self.name}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpuaas.node_agent"],
                env=env,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


@dataclass
class Saga:
    stack: Stack
    gw: httpx.AsyncClient  # the platform admin
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    tenant: str = ""
    project: str = ""
    user_client: httpx.AsyncClient | None = None
    host: dict[str, Any] = field(default_factory=dict)
    agent: Agent | None = None
    allocations: list[str] = field(default_factory=list)
    refused: int = 0
    retries: dict[str, int] = field(default_factory=dict)
    overlaps: list[str] = field(default_factory=list)
    cycles: int = 0  # full cycles done: each cycle's allocations get names of their own (tests/deploy repeats it)
    current: list[str] = field(default_factory=list)  # this cycle's allocations: what wait_all/release_all act on

    @property
    def client(self) -> httpx.AsyncClient:
        assert self.user_client is not None
        return self.user_client

    async def setup(self) -> None:
        gw, run = self.gw, self.run
        r = await call(gw, "POST", "/api/identity/tenants", json={"slug": f"ft-{run}", "name": "Faults"}, ok=(201,))
        self.tenant = r.json()["tenant_id"]
        r = await call(gw, "POST", f"/api/identity/tenants/{self.tenant}/projects", json={"name": "ft"}, ok=(201,))
        self.project = r.json()["project_id"]
        email, password = f"ops-{run}@faults.example.com", "correct-horse-battery"
        r = await call(
            gw,
            "POST",
            f"/api/identity/tenants/{self.tenant}/users",
            json={"email": email, "password": password, "role": None},
            ok=(201,),
        )
        user = r.json()["user_id"]
        await call(
            gw,
            "POST",
            f"/api/identity/projects/{self.project}/members",
            json={"user_id": user, "role": "project_admin"},
            ok=(200, 201),
        )
        r = await call(
            gw,
            "POST",
            "/api/identity/auth/token",
            data={"grant_type": "password", "username": email, "password": password},
            ok=(200,),
        )
        self.user_client = httpx.AsyncClient(
            base_url=self.stack.gateway_url,
            timeout=30,
            headers={"Authorization": f"Bearer {r.json()['access_token']}"},
        )
        await call(
            gw,
            "POST",
            "/api/billing/prices",
            json={
                "unit": "gpu_hour",
                "unit_price": "2.50",
                "currency": "USD",
                "gpu_model": "H100-80GB",
                "shape": "gpu_slice",
                "effective_from": "2020-01-01T00:00:00+00:00",
            },
            ok=(201, 409),
        )
        r = await call(
            gw, "POST", "/api/allocations/hosts", json={"name": f"ft-{run}", "host_class": f"ft-{run}"}, ok=(201,)
        )
        self.host = r.json()
        self.agent = Agent(self.stack, f"ft-{run}", self.host["node_token"])
        self.agent.start()

        async def ready() -> bool:
            h = await call(gw, "GET", f"/api/allocations/hosts/{self.host['host_id']}", ok=(200,))
            return h.json().get("status") == "ready" and len(h.json()["gpus"]) == GPUS_PER_HOST

        await eventually(ready, 90, "the host ready with its agent")

        async def projected() -> bool:  # the project reached allocations', metering's and billing's projections
            a = await self.client.get(f"/api/allocations/projects/{self.project}/allocations")
            b = await self.client.get("/api/billing/costs", params={"project_id": self.project})
            return a.status_code == 200 and b.status_code == 200

        await eventually(projected, 60, "the project in the services' IAM projections")

    async def close(self) -> None:
        if self.agent is not None:
            self.agent.stop()
        if self.user_client is not None:
            await self.user_client.aclose()

    # ------------------------------------------------------------------------------------------ steps

    async def create_until_full(self, extra: int = 1) -> None:
        """Fill the host with concurrent creates; `extra` more must be refused, none double-booked."""
        n = GPUS_PER_HOST // GPUS_PER_ALLOCATION + extra

        async def one(i: int) -> tuple[int, dict[str, Any]]:
            r = await call(
                self.client,
                "POST",
                f"/api/allocations/projects/{self.project}/allocations",
                json={
                    "gpu_model": "H100-80GB",
                    "gpu_count": GPUS_PER_ALLOCATION,
                    "name": f"ft-{self.cycles}-{i}",
                    "host_class": f"ft-{self.run}",
                    "queue": False,  # refused at once when full (the capacity queue is tested on its own)
                },
                ok=(201, 409),
                stats=self.retries,
            )
            if not response_lost(r):
                return r.status_code, r.json()
            # Created, but the answer died with the process: find it, as a client would, by its name.
            self.retries["response lost"] = self.retries.get("response lost", 0) + 1
            listed = await call(self.client, "GET", f"/api/allocations/projects/{self.project}/allocations", ok=(200,))
            mine = [a for a in listed.json() if a["name"] == f"ft-{self.cycles}-{i}"]
            assert len(mine) == 1, f"ft-{self.cycles}-{i}: {mine}"
            return 201, mine[0]

        results = await asyncio.gather(*[one(i) for i in range(n)])
        created = [body["allocation_id"] for status, body in results if status == 201]
        refused = [body for status, body in results if status == 409]
        assert all(p.get("code") == "insufficient_capacity" for p in refused), refused
        assert len(created) == n - extra, f"{len(created)} created, {len(refused)} refused of {n}: {refused}"
        self.allocations += created
        self.current = created
        self.refused += len(refused)

    async def statuses(self, ids: list[str] | None = None) -> dict[str, str]:
        """Each allocation's status (every cycle's unless `ids`)."""
        out = {}
        for aid in self.allocations if ids is None else ids:
            r = await call(self.client, "GET", f"/api/allocations/allocations/{aid}", ok=(200,), stats=self.retries)
            out[aid] = r.json()["status"]
        return out

    async def wait_all(self, wanted: str, timeout_s: float = 180.0) -> None:
        async def done() -> bool:
            await self.check_no_overlap()
            return set((await self.statuses(self.current)).values()) == {wanted}

        await eventually(done, timeout_s, f"every allocation {wanted}", interval_s=0.5)

    async def wait_first_placed(self, timeout_s: float = 60.0) -> None:
        async def one() -> bool:
            r = await self.client.get(f"/api/allocations/projects/{self.project}/allocations")
            return r.status_code == 200 and bool(r.json())

        await eventually(one, timeout_s, "the first allocation placed", interval_s=0.05)

    async def release_all(self) -> None:
        await asyncio.gather(
            *[
                call(self.client, "POST", f"/api/allocations/allocations/{aid}/release", ok=(202,), stats=self.retries)
                for aid in self.current
            ]
        )

    async def check_no_overlap(self) -> None:
        """No GPU of the host held by two live allocations, as the API shows them."""
        r = await call(
            self.client, "GET", f"/api/allocations/projects/{self.project}/allocations", ok=(200,), stats=self.retries
        )
        held: dict[int, str] = {}
        for a in r.json():
            if a["status"] in ("released", "failed") or a.get("host_id") != self.host["host_id"]:
                continue
            for idx in a.get("gpu_indices") or []:
                if idx in held and held[idx] != a["allocation_id"]:
                    self.overlaps.append(f"GPU {idx}: {held[idx]} and {a['allocation_id']}")
                held[idx] = a["allocation_id"]
        assert not self.overlaps, self.overlaps

    async def full_cycle(self) -> None:
        await self.create_until_full()
        await self.wait_all("active")
        await self.release_all()
        await self.wait_all("released")
        self.cycles += 1


# -------------------------------------------------------------------------------------------- invariants


async def check_invariants(saga: Saga, timeout_s: float = 120.0) -> dict[str, Any]:
    """Every saga complete, ledgers balanced, no double booking, no event applied twice."""
    stack = saga.stack
    ids = [uuid.UUID(a) for a in saga.allocations]
    assert set((await saga.statuses()).values()) == {"released"}
    await saga.check_no_overlap()
    # Final assignments: nothing left on the host, never a GPU index twice.
    assert (
        await stack.fetchval("allocations", "SELECT count(*) FROM gpu_assignments WHERE allocation_id = ANY($1)", ids)
        == 0
    )

    async def metered() -> bool:
        rows = await stack.fetch(
            "metering",
            "SELECT allocation_id, status FROM meters WHERE allocation_id = ANY($1)",
            ids,
        )
        return len(rows) == len(ids) and all(r["status"] == "closed" for r in rows)

    try:
        await eventually(metered, timeout_s, "a closed meter per allocation")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{await diagnostics(stack, ids)}") from None
    finals = await stack.fetch(
        "metering",
        "SELECT allocation_id, count(*) FILTER (WHERE final) AS finals, count(*) AS n FROM usage_records "
        "WHERE allocation_id = ANY($1) GROUP BY allocation_id",
        ids,
    )
    assert len(finals) == len(ids) and all(r["finals"] == 1 for r in finals), finals
    records = {
        r["usage_record_id"]
        for r in await stack.fetch(
            "metering", "SELECT usage_record_id FROM usage_records WHERE allocation_id = ANY($1)", ids
        )
    }

    async def charged() -> bool:
        rows = await stack.fetch(
            "billing",
            "SELECT usage_record_id FROM charges WHERE allocation_id = ANY($1)",
            ids,
        )
        return {r["usage_record_id"] for r in rows} == records and len(rows) == len(records)

    await eventually(charged, timeout_s, "every usage record charged once")
    assert (
        await stack.fetchval(
            "billing",
            "SELECT count(*) FROM usage_received WHERE allocation_id = ANY($1) AND status <> 'rated'",
            ids,
        )
        == 0
    )
    row = (
        await stack.fetch(
            "billing",
            """SELECT coalesce(sum(amount) FILTER (WHERE side = 'debit'), 0) AS d,
                      coalesce(sum(amount) FILTER (WHERE side = 'credit'), 0) AS c FROM ledger_entries""",
        )
    )[0]
    assert row["d"] == row["c"], dict(row)
    r = await call(saga.gw, "GET", "/api/billing/ledger/balance", ok=(200,))
    assert r.json()["balanced"] is True, r.json()
    total = await stack.fetchval(
        "billing", "SELECT coalesce(sum(amount), 0) FROM charges WHERE allocation_id = ANY($1)", ids
    )

    async def audited() -> list[Any]:
        rows = await stack.fetch(
            "identity",
            "SELECT resource_id, count(*) AS n FROM audit_records WHERE action = 'allocations.create' "
            "AND resource_id = ANY($1) GROUP BY resource_id",
            [str(i) for i in ids],
        )
        return rows if len(rows) == len(ids) else []

    rows = await eventually(audited, timeout_s, "identity's audit record of each allocation")
    assert all(r["n"] == 1 for r in rows), [dict(r) for r in rows]
    parked = {
        svc: await stack.fetchval(svc, "SELECT count(*) FROM dead_letters WHERE status = 'parked'") for svc in SERVICES
    }
    assert not any(parked.values()), parked
    return {
        "allocations": len(ids),
        "refused": saga.refused,
        "usage_records": len(records),
        "charged": Decimal(total),
        "retried": dict(saga.retries),
    }


def consumer_log_lines(stack: Stack, svc: str, last: int = 6) -> list[str]:
    """The service's last consumer warnings and errors (restarts, stalls, crashes) from its log file."""
    path = stack.logs_dir / f"{svc}.log"
    if not path.exists():
        return []
    wanted = [line for line in path.read_text(errors="replace").splitlines() if '"consumer_' in line]
    return [line[:400] for line in wanted[-last:]]


async def diagnostics(stack: Stack, ids: list[uuid.UUID]) -> str:
    """What each consumer saw: for a failure message."""
    lines = []
    sql = "SELECT allocation_id, status FROM meters WHERE allocation_id = ANY($1)"
    meters = await stack.fetch("metering", sql, ids)
    lines.append(f"meters: {[(str(r['allocation_id'])[-6:], r['status']) for r in meters]}")
    for svc in SERVICES:
        n = await stack.fetchval(svc, "SELECT count(*) FROM inbox")
        async with httpx.AsyncClient(timeout=5) as c:
            try:
                ready = (await c.get(f"{stack.service_url(svc)}/readyz")).text
                metrics = (await c.get(f"{stack.service_url(svc)}/metrics")).text
                lag = sum(float(m.split()[-1]) for m in metrics.splitlines() if "consumer_lag" in m and m[0] != "#")
            except httpx.HTTPError as e:
                ready, lag = repr(e), -1
        lines.append(f"{svc}: inbox={n} lag={lag} readyz={ready}")
        lines.extend(f"  {line}" for line in consumer_log_lines(stack, svc))
    unsent = {svc: await stack.fetchval(svc, "SELECT count(*) FROM outbox WHERE sent_at IS NULL") for svc in SERVICES}
    lines.append(f"unsent outbox rows: {unsent}")
    return "\n".join(lines)
