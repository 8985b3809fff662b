"""Allocations benchmark: create→active latency on an enrolled host, and placement throughput.

Setup (self-contained): embedded Postgres + Tansu, the allocations service (uvicorn, this process,
its real app with relay/consumer/reconciler), one real node-agent process (declared 64 x H100) for
the latency run, and 8 agent-less 8-GPU hosts (heartbeats sent from here) for placement.

1. latency: N sequential creates of a 1-GPU slice; for each, time from POST to the first GET that
   reads `active` (polled every 5 ms), then release. Includes placement, the agent's long-poll
   wake-up (LISTEN/NOTIFY), workspace provisioning and the completion report.
2. throughput: 50 concurrent POSTs (1 GPU each) against 64 free GPUs on 8 hosts; wall time,
   creates/s, and a check that no GPU was handed out twice.

    uv run python bench/allocations.py [--latency-n 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

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


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # uvicorn < 0.29 name
        pass


async def main(latency_n: int, concurrent: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="gpuaas-bench-alloc-"))
    root.chmod(0o755)
    pg = EmbeddedPostgres(root / "pg", port=free_port())
    broker = Tansu(port=free_port(), log_path=root / "tansu.log")
    pg.start()
    broker.start()
    agent_proc = None
    try:
        await ensure_database(pg.admin_url, "gpuaas_bench")
        admin = pg.admin_url.rsplit("/", 1)[0] + "/gpuaas_bench"
        app = await service_app(SPEC, admin, broker.bootstrap, log_level="WARNING", agent_heartbeat_timeout_s=60.0)
        key = ECKey.generate_key("P-256", parameters={"kid": "bench", "alg": "ES256", "use": "sig"})
        sock = socket.socket()
        # Accepted connections inherit TCP_NODELAY: without it a kept-alive connection's small responses
        # can wait on Nagle + the client's delayed ACK (~40 ms a request).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        server = _Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        serve = asyncio.create_task(server.serve(sockets=[sock]))
        await wait_for(lambda: server.started, 60, "server")
        kit = app.state.kit
        kit.verifier.jwks.set(KeySet([key]).as_dict(private=False))
        # Pinned: after its TTL (5 minutes) the cache would refetch from the default identity URL, which
        # does not run here, and every refetch attempt would land on a measured request.
        kit.verifier.jwks.ttl_s = float("inf")
        op, user, tenant, project = (uuid.uuid4() for _ in range(4))
        events = [
            ev.MembershipGranted.build(
                subject=op,
                source="identity",
                data=ev.MembershipState(
                    membership_id=uuid.uuid4(), user_id=op, scope=MembershipScope.platform, role=Role.platform_admin
                ),
            ),
            ev.ProjectCreated.build(
                subject=project,
                source="identity",
                data=ev.ProjectState(project_id=project, tenant_id=tenant, name="bench"),
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

        def token(sub: uuid.UUID) -> str:
            now = int(time.time())
            return jwt.encode(
                {"alg": "ES256", "kid": "bench"},
                {
                    "iss": kit.settings.jwt_issuer,
                    "aud": "gpuaas",
                    "sub": str(sub),
                    "typ": "user",
                    "iat": now,
                    "exp": now + 3600,
                },
                key,
            )

        opc = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token(op)}"}, timeout=60)
        uc = httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {token(user)}"},
            timeout=60,
            limits=httpx.Limits(max_connections=concurrent + 10),
        )

        # 1. latency on a host with a real agent process
        host = (await opc.post("/hosts", json={"name": "bench-agent"})).json()
        env = {
            **os.environ,
            "GPUAAS_AGENT_SERVER_URL": url,
            "GPUAAS_AGENT_NODE_TOKEN": host["node_token"],
            "GPUAAS_AGENT_STATE_DIR": str(root / "agent"),
            "GPUAAS_AGENT_GPUS": "64xH100-80GB",
            "GPUAAS_AGENT_PREFER_NVIDIA_SMI": "false",
        }
        log = (root / "agent.log").open("wb")
        agent_proc = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-m", "gpuaas.node_agent"], env=env, stdout=log, stderr=subprocess.STDOUT
        )

        async def host_ready() -> bool:
            return (await opc.get(f"/hosts/{host['host_id']}")).json()["status"] == "ready"

        await wait_for(host_ready, 60, "agent registration")
        latencies = []
        for _ in range(latency_n):
            t0 = time.perf_counter()
            r = await uc.post(f"/projects/{project}/allocations", json={"gpu_model": "H100-80GB", "gpu_count": 1})
            r.raise_for_status()
            aid = r.json()["allocation_id"]
            while (await uc.get(f"/allocations/{aid}")).json()["status"] != "active":
                await asyncio.sleep(0.005)
            latencies.append(time.perf_counter() - t0)
            await uc.post(f"/allocations/{aid}/release")
        # let the releases drain before the placement run
        async with kit.sessions() as s:

            async def drained() -> bool:
                return (await s.execute(text("SELECT count(*) FROM gpu_assignments"))).scalar_one() == 0

            await wait_for(drained, 60, "releases")
        await opc.post(f"/hosts/{host['host_id']}/cordon", json={"reason": "bench: placement run uses other hosts"})

        # 2. placement throughput: concurrent creates against 8 agent-less hosts (64 GPUs)
        tokens = []
        for i in range(8):
            h = (await opc.post("/hosts", json={"name": f"bench-{i}"})).json()
            tokens.append(h["node_token"])
            r = await httpx.AsyncClient(base_url=url).post(
                "/agent/register",
                headers={"Authorization": f"Bearer {h['node_token']}"},
                json={
                    "agent_version": "bench",
                    "ssh_host": "127.0.0.1",
                    "ssh_port": 2222,
                    "gpus": [{"index": g, "model": "H100-80GB", "memory_mb": 81920} for g in range(8)],
                },
            )
            r.raise_for_status()
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *[
                uc.post(f"/projects/{project}/allocations", json={"gpu_model": "H100-80GB", "gpu_count": 1})
                for _ in range(concurrent)
            ]
        )
        wall = time.perf_counter() - t0
        ok = [r.json() for r in results if r.status_code == 201]
        placed = [(a["host_id"], i) for a in ok for i in a["gpu_indices"]]
        async with kit.sessions() as s:
            assigned = (await s.execute(text("SELECT count(*) FROM gpu_assignments"))).scalar_one()
        out = {
            "create_to_active": {
                "n": latency_n,
                "p50_ms": round(statistics.median(latencies) * 1000, 1),
                "p99_ms": round(pct(latencies, 99) * 1000, 1),
                "max_ms": round(max(latencies) * 1000, 1),
            },
            "placement": {
                "concurrent_creates": concurrent,
                "created": len(ok),
                "wall_s": round(wall, 3),
                "creates_per_s": round(len(ok) / wall, 1),
                "double_booked": len(placed) - len(set(placed)),
                "gpu_assignments": assigned,
                "statuses": sorted({r.status_code for r in results}),
            },
        }
        print(json.dumps(out, indent=2))
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "allocations.json").write_text(json.dumps(out, indent=2) + "\n")
        await opc.aclose()
        await uc.aclose()
        if agent_proc is not None:  # its long-poll would hold the server's graceful shutdown
            agent_proc.terminate()
            agent_proc.wait(10)
        server.should_exit = True
        await asyncio.wait_for(serve, 30)
    finally:
        if agent_proc is not None and agent_proc.poll() is None:
            agent_proc.terminate()
            agent_proc.wait(10)
        broker.stop()
        pg.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-n", type=int, default=50)
    parser.add_argument("--concurrent", type=int, default=50)
    args = parser.parse_args()
    asyncio.run(main(args.latency_n, args.concurrent))
