"""Capacity queue on the real service at scale (issue 29 acceptance "scale"): the allocations service with its
own admission loop, over embedded Postgres and Tansu, with a fleet that is full.

Setup (bulk INSERTs, as bench/scale.py): 1,350 ready 8-GPU hosts, every GPU held by an active 1-GPU allocation
spread over 1,000 queues (100 tenants with weights 1-3, 9 projects each), and 10,000 queued requests of 1 GPU
spread over the same projects. Then:
- enqueue: N sequential POST /projects/{p}/allocations on the full fleet: each answers 201 `queued` with a
  reason and a position (p50/p99); baseline in the same run: GET /healthz on the same connection;
- cycle: the service's admission cycle (`run_cycle`) of the pool on this database, N/5 times committed, with
  nothing to admit (read 10,000 waiting + 10,800 running rows, plan in a worker thread, note positions), p50/p99;
- freed -> admitted: N times, one running allocation is released the way an agent's release report frees it
  (status released, its GPU assignment deleted, the admission NOTIFY, in one transaction); the clock runs from
  that commit until the freed GPU is assigned to a waiting request by the service's loop (polled every 2 ms).

    uv run python bench/capacity_service.py [--hosts 1350] [--waiting 10000] [--n 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from joserfc.jwk import ECKey, KeySet
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).parent))
from scale import _Server, listening_socket, pct, pin_keys, project_member, seed_active, seed_hosts

from gpuaas.allocations.app import SPEC
from gpuaas.allocations.reconciler import preemption_config
from gpuaas.allocations.service.admission_runner import run_cycle
from gpuaas.allocations.settings import Settings
from gpuaas.devstack.infra import EmbeddedPostgres, Tansu, free_port
from gpuaas.kit.provision import ensure_database
from gpuaas.kit.testing import service_app, wait_for

RESULTS = Path(__file__).parent / "results"
GPUS_PER_HOST = 8
MODEL = "H100-80GB"
TENANTS, PROJECTS_PER_TENANT = 100, 9


def ms(values: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(values) * 1000, 2), "p99": round(pct(values, 99) * 1000, 2)}


async def seed_fleet(kit: Any, hosts: list[uuid.UUID], waiting: int, rnd: random.Random) -> list[tuple[uuid.UUID, ...]]:
    """Queues, a full pool of running allocations and `waiting` queued requests; the (tenant, project) pairs."""
    tenants = [uuid.uuid4() for _ in range(TENANTS)]
    projects = [(t, uuid.uuid4()) for t in tenants for _ in range(PROJECTS_PER_TENANT)]
    now = datetime.now(UTC)
    queues = [
        {"q": uuid.uuid4(), "s": "tenant", "id": t, "t": t, "w": float(rnd.choice([1, 2, 3]))} for t in tenants
    ] + [{"q": uuid.uuid4(), "s": "project", "id": p, "t": t, "w": 1.0} for t, p in projects]
    hosts_gpus = [(h, g) for h in hosts for g in range(GPUS_PER_HOST)]
    running = [
        (*projects[i % len(projects)], h, g, now - timedelta(hours=2, seconds=i)) for i, (h, g) in enumerate(hosts_gpus)
    ]
    queued = []
    for i in range(waiting):
        t, p = rnd.choice(projects)
        a = uuid.uuid4()
        at = now - timedelta(minutes=30) + timedelta(milliseconds=i)
        queued.append({"id": a, "t": t, "p": p, "at": at, "u": "a" + a.hex[-11:]})
    async with kit.sessions() as s, s.begin():
        await s.execute(
            text(
                "INSERT INTO capacity_queues (queue_id, scope, scope_id, tenant_id, gpu_model, weight)"
                " VALUES (:q, :s, :id, :t, 'H100-80GB', :w)"
            ),
            queues,
        )
        for chunk in range(0, len(queued), 2000):
            await s.execute(
                text(
                    "INSERT INTO allocations (allocation_id, tenant_id, project_id, shape, gpu_model, gpu_count,"
                    " gpu_indices, status, status_changed_at, ssh_username, requested_at, enqueued_at,"
                    " pending_reason, queue_position)"
                    " VALUES (:id, :t, :p, 'gpu_slice', 'H100-80GB', 1, '[]'::jsonb, 'queued', :at, :u, :at, :at,"
                    " 'no_capacity', 1)"
                ),
                queued[chunk : chunk + 2000],
            )
    await seed_active(kit, running)
    async with kit.sessions() as s:
        for table in ("allocations", "gpu_assignments", "capacity_queues", "host_capacity"):
            await s.execute(text(f"ANALYZE {table}"))
        await s.commit()
    return projects


async def free_one(kit: Any) -> tuple[uuid.UUID, int, float]:
    """Release one running allocation as the agent's release report does; its GPU and the commit time."""
    async with kit.sessions() as s, s.begin():
        row = (
            await s.execute(
                text(
                    "SELECT a.allocation_id, g.host_id, g.gpu_index FROM gpu_assignments g"
                    " JOIN allocations a USING (allocation_id) WHERE a.status = 'active'"
                    " AND a.requested_at < now() - interval '1 hour' ORDER BY random() LIMIT 1"
                ),
            )
        ).one()
        await s.execute(text("DELETE FROM gpu_assignments WHERE allocation_id = :a"), {"a": row.allocation_id})
        await s.execute(
            text(
                "UPDATE allocations SET status = 'released', released_at = now(), status_changed_at = now(),"
                " billing_stopped_at = now(), version = version + 1 WHERE allocation_id = :a"
            ),
            {"a": row.allocation_id},
        )
        await s.execute(text("SELECT pg_notify('allocations_admission', 'H100-80GB')"))
    return row.host_id, row.gpu_index, time.perf_counter()


async def main(n_hosts: int, waiting: int, n: int, seed: int) -> dict[str, Any]:
    rnd = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="gpuaas-bench-capacity-"))
    root.chmod(0o755)
    pg = EmbeddedPostgres(root / "pg", port=free_port())
    broker = Tansu(port=free_port(), log_path=root / "tansu.log")
    pg.start()
    broker.start()
    try:
        await ensure_database(pg.admin_url, "gpuaas_bench")
        admin = pg.admin_url.rsplit("/", 1)[0] + "/gpuaas_bench"
        app = await service_app(
            SPEC,
            admin,
            broker.bootstrap,
            log_level="WARNING",
            agent_heartbeat_timeout_s=86400.0,
            admission_resync_s=5.0,  # wake-ups drive admission; the timer is the safety net
        )
        key = ECKey.generate_key("P-256", parameters={"kid": "bench", "alg": "ES256", "use": "sig"})
        sock = listening_socket()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server = _Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        serve = asyncio.create_task(server.serve(sockets=[sock]))
        await wait_for(lambda: server.started, 60, "server")
        kit = app.state.kit
        pin_keys(kit, dict(KeySet([key]).as_dict(private=False)))

        t0 = time.perf_counter()
        hosts = await seed_hosts(kit, n_hosts)
        async with kit.sessions() as s, s.begin():  # hosts tenants may share (no runtime image to resolve)
            await s.execute(text("UPDATE hosts SET driver = 'process', isolates_tenants = true"))
        projects = await seed_fleet(kit, hosts, waiting, rnd)
        seed_s = time.perf_counter() - t0
        print(f"seeded {n_hosts} hosts, {len(projects)} projects, {waiting} waiting in {seed_s:.1f}s", flush=True)

        tenant, project = projects[0]
        token = await project_member(kit, key, tenant, project)
        c = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)

        pings, enqueues = [], []
        for _ in range(n):
            t = time.perf_counter()
            assert (await c.get("/healthz")).status_code == 200
            pings.append(time.perf_counter() - t)
        for _ in range(n):
            t = time.perf_counter()
            r = await c.post(f"/projects/{project}/allocations", json={"gpu_model": MODEL, "gpu_count": 1})
            enqueues.append(time.perf_counter() - t)
            body = r.json()
            assert r.status_code == 201 and body["status"] == "queued" and body["pending_reason"], r.text
        print(f"enqueue {ms(enqueues)} (healthz {ms(pings)})", flush=True)

        config = preemption_config(kit.settings_as(Settings))
        cycles = []
        for _ in range(max(5, n // 5) + 1):  # the first may still write positions: left out
            t = time.perf_counter()
            async with kit.sessions() as s, s.begin():
                result = await run_cycle(s, MODEL, config)
            cycles.append(time.perf_counter() - t)
            assert not result.admitted
        first, cycles = cycles[0], cycles[1:]
        print(f"admission cycle {ms(cycles)} (first {first * 1000:.0f} ms)", flush=True)

        freed_to_admitted = []
        for _ in range(n):
            host_id, gpu, freed_at = await free_one(kit)

            async def taken(host_id: uuid.UUID = host_id, gpu: int = gpu) -> bool:
                async with kit.sessions() as s:
                    q = "SELECT 1 FROM gpu_assignments WHERE host_id = :h AND gpu_index = :g"
                    return (await s.execute(text(q), {"h": host_id, "g": gpu})).first() is not None

            while not await taken():
                await asyncio.sleep(0.002)
                if time.perf_counter() - freed_at > 30:
                    raise RuntimeError("a freed GPU was not admitted within 30 s")
            freed_to_admitted.append(time.perf_counter() - freed_at)
        print(f"freed -> admitted {ms(freed_to_admitted)}", flush=True)
        await c.aclose()
        server.should_exit = True
        await asyncio.wait_for(serve, 30)
        return {
            "hosts": n_hosts,
            "gpus": n_hosts * GPUS_PER_HOST,
            "queues": TENANTS * (1 + PROJECTS_PER_TENANT),
            "waiting": waiting,
            "n": n,
            "seed_s": round(seed_s, 1),
            "healthz_ms": ms(pings),
            "enqueue_ms": ms(enqueues),
            "enqueue_p99_vs_healthz_p99": round(pct(enqueues, 99) / pct(pings, 99), 1),
            "admission_cycle_ms": ms(cycles),
            "freed_to_admitted_ms": ms(freed_to_admitted),
        }
    finally:
        broker.stop()
        pg.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=1350)
    parser.add_argument("--waiting", type=int, default=10_000)
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--seed", type=int, default=29)
    args = parser.parse_args()
    result = asyncio.run(main(args.hosts, args.waiting, args.n, args.seed))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "capacity_service.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
