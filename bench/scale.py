"""Scale benchmark (issue 18): allocation create (POST → placed) and list latency, and RSS, against a
fleet of 1,350 8-GPU hosts at 0, 1,000, 5,000 and 10,000 existing allocations, printed as a table.

Setup (self-contained): embedded Postgres + Tansu, the allocations service (uvicorn in this process,
its real app with relay/consumer/reconciler, listening with TCP_NODELAY), the JWKS pinned (no refetch
from a default identity URL once the 5-minute cache would expire). Hosts and existing allocations are
bulk-seeded with INSERTs straight into the allocations schema: hosts `ready` with a fresh heartbeat
(the heartbeat timeout is set to a day), allocations `active`, one GPU each on a random free GPU
(seeded RNG) with their gpu_assignments rows, all in one project. Between levels only the missing
allocations are added (the creates measured at a level count towards the next one).

Per level:
- create: N sequential POST /projects/{p}/allocations (1-GPU gpu_slice) on one kept-alive connection;
  the 201 carries the placed host and GPUs;
- list: N sequential GET /projects/{p}/allocations?include_released=true at the default page (500),
  at limit=100, and a deep page (a cursor from the middle of the list, limit=100);
- RSS: this process's resident set after the level (server + bench client; the client is small).

    uv run python bench/scale.py [--levels 0,1000,5000,10000] [--hosts 1350] [--n 200] [--before]

`--before` swaps in the placement of the parent commit (every host and every assignment read twice
per create), read from `git show HEAD:...`, to print the before figures with the same harness.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import tempfile
import time
import types
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx
import uvicorn
from joserfc import jwt
from joserfc.jwk import ECKey, KeySet
from sqlalchemy import text

from gpuaas.allocations.app import SPEC
from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.events import identity as ev
from gpuaas.devstack.infra import EmbeddedPostgres, Tansu, free_port
from gpuaas.kit.iam import apply_locally
from gpuaas.kit.provision import ensure_database
from gpuaas.kit.testing import service_app, wait_for

RESULTS = Path(__file__).parent / "results"
GPUS_PER_HOST = 8
MODEL = "H100-80GB"


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def ms(values: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(values) * 1000, 1), "p99": round(pct(values, 99) * 1000, 1)}


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # uvicorn < 0.29 name
        pass


def listening_socket() -> socket.socket:
    """Bound, with TCP_NODELAY (accepted connections inherit it): without it a kept-alive
    connection's small responses can wait on Nagle + the peer's delayed ACK (~40 ms)."""
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def pin_keys(kit: Any, jwks: dict[str, Any]) -> None:
    """Install the bench's signing keys for good: the cache would otherwise go stale after its TTL
    (5 minutes) and refetch from the default identity URL, which is not running here."""
    kit.verifier.jwks.set(jwks)
    kit.verifier.jwks.ttl_s = float("inf")


def use_parent_placement() -> None:
    """--before: the placement module of HEAD (the parent of this change), patched into lifecycle."""
    path = "services/allocations/src/gpuaas/allocations/service/placement.py"
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=root, check=True, capture_output=True, text=True)
    old = types.ModuleType("gpuaas.allocations.service.placement_before")
    exec(compile(source.stdout, "placement_before.py", "exec"), old.__dict__)
    from gpuaas.allocations.service import lifecycle

    lifecycle._place = old._place
    lifecycle._capacities = old._capacities


async def seed_hosts(kit: Any, n: int) -> list[uuid.UUID]:
    ids = [uuid.uuid4() for _ in range(n)]
    gpus = json.dumps([{"index": g, "model": MODEL, "memory_mb": 81920} for g in range(GPUS_PER_HOST)])
    rows = [{"id": h, "name": f"scale-{i:05d}", "gpus": gpus} for i, h in enumerate(ids)]
    async with kit.sessions() as s, s.begin():
        await s.execute(
            text(
                "INSERT INTO hosts (host_id, name, status, gpus, node_token_hash, inventory_source, agent_version,"
                " last_heartbeat_at, ssh_host, ssh_port)"
                " VALUES (:id, :name, 'ready', CAST(:gpus AS jsonb), 'x', 'agent', 'bench', now(), '127.0.0.1', 2222)"
            ),
            rows,
        )
    return ids


async def project_member(kit: Any, key: ECKey, tenant: uuid.UUID, project: uuid.UUID) -> str:
    """A new member of `project` in the service's projection (as identity's events would make it) and a day-long
    token for them signed with the bench's key."""
    user = uuid.uuid4()
    events = [
        ev.ProjectCreated.build(
            subject=project, source="identity", data=ev.ProjectState(project_id=project, tenant_id=tenant, name="s")
        ),
        ev.MembershipGranted.build(
            subject=user,
            source="identity",
            data=ev.MembershipState(
                membership_id=uuid.uuid4(),
                user_id=user,
                scope=MembershipScope.project,
                role=Role.project_member,
                tenant_id=tenant,
                project_id=project,
            ),
        ),
    ]
    async with kit.sessions() as s, s.begin():
        for e in events:
            await apply_locally(s, e)
    now = int(time.time())
    claims = {"iss": kit.settings.jwt_issuer, "aud": "gpuaas", "sub": str(user), "typ": "user"}
    return jwt.encode({"alg": "ES256", "kid": "bench"}, {**claims, "iat": now, "exp": now + 86400}, key)


async def seed_active(kit: Any, placed: list[tuple[uuid.UUID, uuid.UUID, uuid.UUID, int, datetime]]) -> None:
    """Active 1-GPU allocations [(tenant, project, host, gpu, at)] with their gpu_assignments rows, in chunks."""
    allocs, assigns = [], []
    for tenant, project, host_id, gpu, at in placed:
        a = uuid.uuid4()
        allocs.append(
            {"id": a, "t": tenant, "p": project, "h": host_id, "g": json.dumps([gpu]), "at": at, "u": "a" + a.hex[-11:]}
        )
        assigns.append({"h": host_id, "g": gpu, "a": a})
    async with kit.sessions() as s, s.begin():
        for chunk in range(0, len(allocs), 2000):
            await s.execute(
                text(
                    "INSERT INTO allocations (allocation_id, tenant_id, project_id, shape, gpu_model, gpu_count,"
                    " gpu_indices, host_id, status, status_changed_at, ssh_username, requested_at, activated_at)"
                    " VALUES (:id, :t, :p, 'gpu_slice', 'H100-80GB', 1, CAST(:g AS jsonb), :h, 'active', :at, :u,"
                    " :at, :at)"
                ),
                allocs[chunk : chunk + 2000],
            )
            await s.execute(
                text("INSERT INTO gpu_assignments (host_id, gpu_index, allocation_id) VALUES (:h, :g, :a)"),
                assigns[chunk : chunk + 2000],
            )


async def seed_allocations(
    kit: Any, free: list[tuple[uuid.UUID, int]], n: int, tenant: uuid.UUID, project: uuid.UUID, t0: datetime
) -> None:
    """`n` active 1-GPU allocations on GPUs taken from `free` (already shuffled)."""
    placed = []
    for i in range(n):
        host_id, gpu = free.pop()
        placed.append((tenant, project, host_id, gpu, t0 + timedelta(milliseconds=i)))
    await seed_active(kit, placed)
    async with kit.sessions() as s:
        await s.execute(text("ANALYZE allocations; "))
        await s.execute(text("ANALYZE gpu_assignments"))
        await s.commit()


async def timed(n: int, call: Any) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t)
    return out


async def main(levels: list[int], n_hosts: int, n: int, before: bool) -> dict[str, Any]:
    if before:
        use_parent_placement()
    root = Path(tempfile.mkdtemp(prefix="gpuaas-bench-scale-"))
    root.chmod(0o755)
    pg = EmbeddedPostgres(root / "pg", port=free_port())
    broker = Tansu(port=free_port(), log_path=root / "tansu.log")
    pg.start()
    broker.start()
    try:
        await ensure_database(pg.admin_url, "gpuaas_bench")
        admin = pg.admin_url.rsplit("/", 1)[0] + "/gpuaas_bench"
        app = await service_app(SPEC, admin, broker.bootstrap, log_level="WARNING", agent_heartbeat_timeout_s=86400.0)
        key = ECKey.generate_key("P-256", parameters={"kid": "bench", "alg": "ES256", "use": "sig"})
        sock = listening_socket()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server = _Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        serve = asyncio.create_task(server.serve(sockets=[sock]))
        await wait_for(lambda: server.started, 60, "server")
        kit = app.state.kit
        pin_keys(kit, KeySet([key]).as_dict(private=False))
        tenant, project = uuid.uuid4(), uuid.uuid4()
        token = await project_member(kit, key, tenant, project)
        t_seed = time.perf_counter()
        host_ids = await seed_hosts(kit, n_hosts)
        free = [(h, g) for h in host_ids for g in range(GPUS_PER_HOST)]
        random.Random(18).shuffle(free)
        seed_s = time.perf_counter() - t_seed
        rows: list[dict[str, Any]] = []
        c = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        lst = f"/projects/{project}/allocations"
        t_old = datetime(2026, 1, 1, tzinfo=UTC)
        for level in levels:
            async with kit.sessions() as s:
                have = (await s.execute(text("SELECT count(*) FROM allocations"))).scalar_one()
            if level > have:
                t = time.perf_counter()
                await seed_allocations(kit, free, level - have, tenant, project, t_old)
                t_old += timedelta(hours=1)
                seed_s += time.perf_counter() - t
            async with kit.sessions() as s:
                existing = (await s.execute(text("SELECT count(*) FROM allocations"))).scalar_one()

            async def create() -> None:
                r = await c.post(lst, json={"gpu_model": MODEL, "gpu_count": 1})
                assert r.status_code == 201, r.text
                body = r.json()
                assert body["host_id"] and len(body["gpu_indices"]) == 1

            async def ping() -> None:
                r = await c.get("/healthz")
                assert r.status_code == 200

            pings = await timed(n, ping)
            creates = await timed(n, create)
            # the created GPUs are no longer free for later seeding
            async with kit.sessions() as s:
                used = {
                    (r.host_id, r.gpu_index)
                    for r in await s.execute(text("SELECT host_id, gpu_index FROM gpu_assignments"))
                }
            free[:] = [f for f in free if f not in used]

            async def list_default() -> None:
                r = await c.get(lst, params={"include_released": "true"})
                assert r.status_code == 200

            async def list_100() -> None:
                r = await c.get(lst, params={"include_released": "true", "limit": "100"})
                assert r.status_code == 200

            deep_url = lst + "?include_released=true&limit=100"
            r = await c.get(lst, params={"include_released": "true", "limit": str(max(1, existing // 2))})
            if "next" in r.links:
                deep_url = urljoin(str(r.url), r.links["next"]["url"]).replace(
                    f"limit={max(1, existing // 2)}", "limit=100"
                )

            async def list_deep(deep_url: str = deep_url) -> None:
                r = await c.get(deep_url)
                assert r.status_code == 200

            lists = await timed(n, list_default)
            lists100 = await timed(n, list_100)
            deep = await timed(n, list_deep)
            rows.append(
                {
                    "existing": existing,
                    "healthz": ms(pings),
                    "create": ms(creates),
                    "list_default_page": ms(lists),
                    "list_limit_100": ms(lists100),
                    "list_deep_page_100": ms(deep),
                    "rss_mib": rss_mib(),
                }
            )
            print(f"level {level}: {rows[-1]}", flush=True)
        await c.aclose()
        server.should_exit = True
        await asyncio.wait_for(serve, 30)
        return {
            "placement": "parent commit (before)" if before else "host_capacity (after)",
            "hosts": n_hosts,
            "gpus_per_host": GPUS_PER_HOST,
            "n_per_measure": n,
            "seed_s": round(seed_s, 1),
            "levels": rows,
        }
    finally:
        broker.stop()
        pg.stop()


def table(result: dict[str, Any]) -> str:
    head = (
        f"{'existing':>9} | {'healthz p50':>11} | {'create p50':>10} {'p99':>7} | {'list(500) p50':>13} {'p99':>7} | "
        f"{'list(100) p50':>13} {'p99':>7} | {'deep(100) p50':>13} {'p99':>7} | {'RSS MiB':>8}"
    )
    lines = [
        f"{result['placement']}: {result['hosts']} hosts x {result['gpus_per_host']} GPUs, n={result['n_per_measure']}",
        head,
        "-" * len(head),
    ]
    for r in result["levels"]:
        lines.append(
            f"{r['existing']:>9} | {r['healthz']['p50']:>11} | {r['create']['p50']:>10} {r['create']['p99']:>7} | "
            f"{r['list_default_page']['p50']:>13} {r['list_default_page']['p99']:>7} | "
            f"{r['list_limit_100']['p50']:>13} {r['list_limit_100']['p99']:>7} | "
            f"{r['list_deep_page_100']['p50']:>13} {r['list_deep_page_100']['p99']:>7} | {r['rss_mib']:>8}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="0,1000,5000,10000")
    parser.add_argument("--hosts", type=int, default=1350)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--before", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(main([int(x) for x in args.levels.split(",")], args.hosts, args.n, args.before))
    print(table(result))
    RESULTS.mkdir(exist_ok=True)
    name = "scale_before.json" if args.before else "scale.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
