"""Bounded load test of the main read and write paths through the gateway, on loopback.

Setup (self-contained): the whole stack as processes (`gpuaas.devstack.Stack`: every service, the
gateway, embedded Postgres, Tansu or with `--broker kafka` Apache Kafka), one node-agent process with
64 declared H100s, a tenant with one project and `--users` project admins (each its own token, so the
gateway's per-principal rate limit applies as it would to real users).

Load: `--workers` concurrent clients for `--duration` seconds (default 60), each picking an operation
by weight (80 % reads, 20 % writes):
  reads   GET allocations list · GET identity /me · GET catalog apps · GET billing costs ·
          GET metering meters · GET app-runtime instances
  writes  POST allocation (1 GPU) then POST its release · POST an SSH key then DELETE it ·
          POST a project (identity)
Printed: requests, throughput, error rate (any non-2xx, 429 counted apart), p50/p99 per operation and
overall, and the resident memory (RSS, the process and its children) of every service before and after
the run (and the difference). Results also go to bench/results/load.json.

    uv run python bench/load.py [--duration 60] [--workers 16] [--broker tansu|kafka]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import asyncssh
import httpx
import psutil

from gpuaas.devstack.stack import Stack, StackConfig
from gpuaas.devstack.testing import remove_root, temp_root

RESULTS = Path(__file__).parent / "results"
READS = {
    "GET allocations": 20,
    "GET identity/me": 15,
    "GET catalog/apps": 15,
    "GET billing/costs": 10,
    "GET metering/meters": 10,
    "GET app-runtime/instances": 10,
}
WRITES = {"POST+release allocation": 8, "POST+DELETE ssh-key": 6, "POST project": 6}


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def new_key() -> str:
    return asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode()


def rss_mb(pid: int | None) -> float:
    if not pid:
        return float("nan")
    try:
        p = psutil.Process(pid)
        return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2**20
    except psutil.Error:
        return float("nan")


class Load:
    def __init__(self, stack: Stack, clients: list[httpx.AsyncClient], tenant: str, project: str) -> None:
        self.stack, self.clients, self.tenant, self.project = stack, clients, tenant, project
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, int] = defaultdict(int)
        self.throttled = 0
        self.full = 0
        self.samples: list[str] = []

    async def req(
        self, c: httpx.AsyncClient, op: str, method: str, url: str, ok: tuple[int, ...], **kw
    ) -> httpx.Response | None:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            r = await c.request(method, url, **kw)
        except httpx.HTTPError as exc:
            self.errors[op] += 1
            self.samples.append(f"{op}: {type(exc).__name__}")
            return None
        self.lat[op].append(time.perf_counter() - t0)
        if r.status_code == 429:
            self.throttled += 1
            return None
        if r.status_code not in ok:
            self.errors[op] += 1
            if len(self.samples) < 20:
                self.samples.append(f"{op}: {r.status_code} {r.text[:160]}")
            return None
        return r

    async def one(self, c: httpx.AsyncClient, op: str) -> None:
        p = self.project
        if op == "GET allocations":
            await self.req(c, op, "GET", f"/api/allocations/projects/{p}/allocations", (200,))
        elif op == "GET identity/me":
            await self.req(c, op, "GET", "/api/identity/me", (200,))
        elif op == "GET catalog/apps":
            await self.req(c, op, "GET", "/api/catalog/apps", (200,))
        elif op == "GET billing/costs":
            await self.req(c, op, "GET", "/api/billing/costs", (200,), params={"project_id": p})
        elif op == "GET metering/meters":
            await self.req(c, op, "GET", "/api/metering/meters", (200,), params={"project_id": p})
        elif op == "GET app-runtime/instances":
            await self.req(c, op, "GET", "/api/app-runtime/instances", (200,), params={"project_id": p})
        elif op == "POST+release allocation":
            r = await self.req(
                c,
                op,
                "POST",
                f"/api/allocations/projects/{p}/allocations",
                (201, 409),
                json={"gpu_model": "H100-80GB", "gpu_count": 1, "host_class": "bench", "queue": False},
                headers={"Idempotency-Key": str(uuid.uuid4())},
            )
            if r is not None and r.status_code == 409:
                self.full += 1  # the 64 GPUs are all booked (releases not yet done by the agent): a valid answer
            elif r is not None:
                await self.req(
                    c,
                    "POST release",
                    "POST",
                    f"/api/allocations/allocations/{r.json()['allocation_id']}/release",
                    (202, 409),
                )
        elif op == "POST+DELETE ssh-key":
            r = await self.req(
                c,
                op,
                "POST",
                "/api/allocations/ssh-keys",
                (201,),
                json={"name": f"k-{uuid.uuid4().hex[:8]}", "public_key": new_key()},
            )
            if r is not None:
                await self.req(c, "DELETE ssh-key", "DELETE", f"/api/allocations/ssh-keys/{r.json()['key_id']}", (204,))
        elif op == "POST project":
            await self.req(
                c,
                op,
                "POST",
                f"/api/identity/tenants/{self.tenant}/projects",
                (201,),
                json={"name": f"p-{uuid.uuid4().hex[:10]}"},
            )

    async def worker(self, i: int, deadline: float) -> None:
        rng = random.Random(i)
        ops = {**READS, **WRITES}
        names, weights = list(ops), list(ops.values())
        c = self.clients[i % len(self.clients)]
        while time.monotonic() < deadline:
            await self.one(c, rng.choices(names, weights)[0])


def start_agent(stack: Stack, token: str) -> subprocess.Popen:
    env = stack.agent_env("bench", token, "64xH100-80GB")
    with open(stack.logs_dir / "agent-bench.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "gpuaas.node_agent"], env=env, stdout=log, stderr=log, start_new_session=True
        )


async def setup(stack: Stack, users: int) -> tuple[list[httpx.AsyncClient], str, str, subprocess.Popen]:
    email, password = stack.admin_login
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        tok = (
            await c.post(
                "/api/identity/auth/token", data={"grant_type": "password", "username": email, "password": password}
            )
        ).json()["access_token"]
    gw = httpx.AsyncClient(base_url=stack.gateway_url, timeout=30, headers={"Authorization": f"Bearer {tok}"})
    run = uuid.uuid4().hex[:6]
    tenant = (await gw.post("/api/identity/tenants", json={"slug": f"load-{run}", "name": "Load"})).json()["tenant_id"]
    project = (await gw.post(f"/api/identity/tenants/{tenant}/projects", json={"name": "load"})).json()["project_id"]
    host = (await gw.post("/api/allocations/hosts", json={"name": f"bench-{run}", "host_class": "bench"})).json()
    agent = await asyncio.to_thread(start_agent, stack, host["node_token"])
    clients = []
    for i in range(users):
        mail = f"load{i}-{run}@load.example.com"
        r = await gw.post(
            f"/api/identity/tenants/{tenant}/users",
            json={"email": mail, "password": "correct-horse-battery", "role": "tenant_admin"},
        )
        uid = r.json()["user_id"]
        await gw.post(f"/api/identity/projects/{project}/members", json={"user_id": uid, "role": "project_admin"})
        r = await gw.post(
            "/api/identity/auth/token",
            data={"grant_type": "password", "username": mail, "password": "correct-horse-battery"},
        )
        clients.append(
            httpx.AsyncClient(
                base_url=stack.gateway_url,
                timeout=30,
                headers={"Authorization": f"Bearer {r.json()['access_token']}"},
                limits=httpx.Limits(max_connections=64),
            )
        )
    # Ready when the host serves and every service's projection knows the project.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        h = (await gw.get(f"/api/allocations/hosts/{host['host_id']}")).json()
        c = clients[-1]
        checks = [
            h.get("status") == "ready",
            (await c.get(f"/api/allocations/projects/{project}/allocations")).status_code == 200,
            (await c.get("/api/billing/costs", params={"project_id": project})).status_code == 200,
            (await c.get("/api/metering/meters", params={"project_id": project})).status_code == 200,
            (await c.get("/api/app-runtime/instances", params={"project_id": project})).status_code == 200,
        ]
        if all(checks):
            break
        await asyncio.sleep(0.5)
    else:
        raise SystemExit(f"setup did not converge: {checks}")
    await gw.aclose()
    return clients, tenant, project, agent


async def main(args: argparse.Namespace) -> dict:
    root = temp_root("gpuaas-bench-load-")
    stack = Stack(StackConfig.from_env(root=root, free_ports=True, broker=args.broker, agents=()))
    t0 = time.monotonic()
    await asyncio.to_thread(stack.start)
    print(f"stack ({args.broker}) ready in {time.monotonic() - t0:.1f}s", flush=True)
    agent = None
    try:
        clients, tenant, project, agent = await setup(stack, args.users)
        load = Load(stack, clients, tenant, project)
        for _ in range(20):  # warm-up: imports, connection pools, JIT-less first paths
            await load.one(clients[0], random.choice([*READS, *WRITES]))
        load.lat.clear()
        load.errors.clear()
        load.throttled = 0
        load.full = 0
        load.samples.clear()
        names = stack.names
        before = {n: rss_mb(stack.pid(n)) for n in names}
        started = time.monotonic()
        await asyncio.gather(*[load.worker(i, started + args.duration) for i in range(args.workers)])
        elapsed = time.monotonic() - started
        await asyncio.sleep(2)
        after = {n: rss_mb(stack.pid(n)) for n in names}
        for c in clients:
            await c.aclose()
    finally:
        if agent is not None and agent.poll() is None:
            os.killpg(agent.pid, signal.SIGTERM)
            agent.wait(15)
        await asyncio.to_thread(stack.stop)
        remove_root(root)
    all_lat = [x for v in load.lat.values() for x in v]
    total = len(all_lat) + sum(e for op, e in load.errors.items() if op not in load.lat)
    errors = sum(load.errors.values())
    result = {
        "broker": args.broker,
        "duration_s": round(elapsed, 1),
        "workers": args.workers,
        "users": args.users,
        "requests": total,
        "throughput_rps": round(total / elapsed, 1),
        "errors": errors,
        "error_rate": round(errors / max(total, 1), 5),
        "throttled_429": load.throttled,
        "capacity_full_409": load.full,
        "p50_ms": round(pct(all_lat, 50) * 1000, 1),
        "p99_ms": round(pct(all_lat, 99) * 1000, 1),
        "operations": {
            op: {
                "n": len(v),
                "errors": load.errors.get(op, 0),
                "p50_ms": round(pct(v, 50) * 1000, 1),
                "p99_ms": round(pct(v, 99) * 1000, 1),
            }
            for op, v in sorted(load.lat.items())
        },
        "rss_mb": {
            n: {"before": round(before[n], 1), "after": round(after[n], 1), "delta": round(after[n] - before[n], 1)}
            for n in names
        },
        "error_samples": load.samples[:10],
    }
    return result


def report(r: dict) -> None:
    print(
        f"\n{r['requests']} requests in {r['duration_s']}s ({r['throughput_rps']}/s), {r['workers']} workers, "
        f"{r['users']} users, broker {r['broker']}"
    )
    print(
        f"errors {r['errors']} ({r['error_rate']:.3%}), throttled (429) {r['throttled_429']}, "
        f"creates refused for capacity (409 insufficient_capacity) {r['capacity_full_409']}"
    )
    print(f"overall p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms\n")
    print(f"{'operation':32} {'n':>6} {'err':>5} {'p50 ms':>8} {'p99 ms':>8}")
    for op, o in r["operations"].items():
        print(f"{op:32} {o['n']:>6} {o['errors']:>5} {o['p50_ms']:>8} {o['p99_ms']:>8}")
    print(f"\n{'process':14} {'RSS before':>11} {'after':>9} {'delta':>8}  (MB)")
    for n, m in r["rss_mb"].items():
        print(f"{n:14} {m['before']:>11} {m['after']:>9} {m['delta']:>+8}")
    if r["error_samples"]:
        print("\nerror samples:", *r["error_samples"], sep="\n  ")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--broker", choices=["tansu", "kafka"], default="tansu")
    args = ap.parse_args()
    res = asyncio.run(main(args))
    report(res)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "load.json").write_text(json.dumps(res, indent=2) + "\n")
