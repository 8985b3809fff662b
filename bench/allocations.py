"""Allocations benchmark: create→active latency on enrolled hosts of both runtime drivers, and placement
throughput.

Setup (self-contained): embedded Postgres + Tansu, the allocations service (uvicorn, this process,
its real app with relay/consumer/reconciler), a real OCI registry (Debian's docker-registry) holding the
`gpuaas-base` runtime image (built from Debian packages once, cached; see gpuaas.devstack.runtime_images)
and registered in allocations' runtime projection as the catalog would publish it, two real node-agent
processes (declared 8 x H100 each): one on the `process` driver, one on the `container` driver (podman,
runc, deploy/local/containers.conf), and 8 agent-less 8-GPU hosts (heartbeats sent from here) for placement.

1. latency: N rounds; each round creates a 1-GPU slice on the process host, then one on the container
   host (interleaved, so both see the same machine load), timing POST to the first GET that reads
   `active` (polled every 5 ms); each is released and its release awaited (not timed) before the next.
   Includes placement, the agent's long-poll wake-up (LISTEN/NOTIFY), provisioning (container: create +
   start from the warm image, gpuaas-init, limits and devices) and the completion report. One warm-up
   allocation per driver (the container host pulls the image by digest) is not counted.
   Prints p50/p99/max per driver and the container/process ratios. Goal (issue 14): container p50 ≤ 1 s,
   p99 ≤ 2 s on the 2-core development machine.
2. throughput: 50 concurrent POSTs (1 GPU each) against 64 free GPUs on 8 hosts; wall time,
   creates/s, and a check that no GPU was handed out twice.

    uv run python bench/allocations.py [--latency-n 20]
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
from gpuaas.allocations.service.runtimes import record_artifact, record_runtime_manifest
from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.events import catalog as cat
from gpuaas.contracts.events import identity as ev
from gpuaas.devstack.agents import agent_base_env, write_token_file
from gpuaas.devstack.infra import EmbeddedPostgres, Tansu, free_port
from gpuaas.devstack.registry import LocalRegistry
from gpuaas.devstack.runtime_images import CONTAINERS_CONF, ensure_images, push_images
from gpuaas.kit.iam import apply_locally
from gpuaas.kit.provision import ensure_database
from gpuaas.kit.testing import service_app, wait_for

RESULTS = Path(__file__).parent / "results"
DRIVERS = ("process", "container")
RUNTIME = "gpuaas-base"  # the platform default runtime: what a create without `runtime` gets on a container host


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def figures(latencies: list[float]) -> dict[str, float]:
    return {
        "n": len(latencies),
        "p50_ms": round(statistics.median(latencies) * 1000, 1),
        "p99_ms": round(pct(latencies, 99) * 1000, 1),
        "max_ms": round(max(latencies) * 1000, 1),
    }


async def publish_runtime(kit: object, ref: str, digest: str) -> None:
    """What allocations' consumer records when the catalog publishes an active `runtime` app (the catalog
    service is not part of this bench)."""
    artifact_id = uuid.uuid4()
    artifact = cat.ArtifactState(
        artifact_id=artifact_id,
        kind=cat.ArtifactKind.oci,
        ref=ref,
        digest=digest,
        state=cat.ArtifactLifecycle.active,
        version=1,
    )
    manifest = cat.AppManifestState(
        manifest_id=uuid.uuid4(),
        slug=RUNTIME,
        display_name="GPUaaS base",
        version="1.0.0",
        artifact_kind=cat.AppArtifactKind.runtime,
        artifact_ref=ref,
        artifact_id=artifact_id,
        active=True,
        revision=1,
    )
    async with kit.sessions() as s, s.begin():  # type: ignore[attr-defined]
        await record_artifact(s, artifact)
        await record_runtime_manifest(s, manifest, deprecated=False)


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # uvicorn < 0.29 name
        pass


async def main(latency_n: int, concurrent: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="gpuaas-bench-alloc-"))
    root.chmod(0o755)
    pg = EmbeddedPostgres(root / "pg", port=free_port())
    broker = Tansu(port=free_port(), log_path=root / "tansu.log")
    registry = LocalRegistry(root / "registry")
    pg.start()
    broker.start()
    registry.start()
    agent_procs: list[subprocess.Popen] = []
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

        # 1. latency on two hosts with a real agent process each: process driver, container driver
        runtime = push_images(ensure_images([RUNTIME]), registry.address)[RUNTIME]
        await publish_runtime(kit, runtime.ref, runtime.digest)
        hosts = {}
        for driver in DRIVERS:
            h = (await opc.post("/hosts", json={"name": f"bench-{driver}", "host_class": f"bench-{driver}"})).json()
            env = agent_base_env() | {
                "GPUAAS_AGENT_SERVER_URL": url,
                "GPUAAS_AGENT_NODE_TOKEN_FILE": str(write_token_file(root / f"{driver}.node-token", h["node_token"])),
                "GPUAAS_AGENT_STATE_DIR": str(root / f"agent-{driver}"),
                "GPUAAS_AGENT_GPUS": "8xH100-80GB",
                "GPUAAS_AGENT_PREFER_NVIDIA_SMI": "false",
                "GPUAAS_AGENT_DRIVER": driver,
                "GPUAAS_AGENT_CONTAINERS_CONF": str(CONTAINERS_CONF),
                "GPUAAS_AGENT_REGISTRY_INSECURE": "true",
            }
            log = (root / f"agent-{driver}.log").open("wb")
            agent_procs.append(
                subprocess.Popen(  # noqa: ASYNC220
                    [sys.executable, "-m", "gpuaas.node_agent"], env=env, stdout=log, stderr=subprocess.STDOUT
                )
            )
            hosts[driver] = h

            async def host_ready(h: dict = h) -> bool:
                return (await opc.get(f"/hosts/{h['host_id']}")).json()["status"] == "ready"

            await wait_for(host_ready, 90, f"{driver} agent registration")

        async def create_to_active(driver: str) -> tuple[float, dict]:
            body = {"gpu_model": "H100-80GB", "gpu_count": 1, "host_class": f"bench-{driver}"}
            t0 = time.perf_counter()
            r = await uc.post(f"/projects/{project}/allocations", json=body)
            r.raise_for_status()
            aid = r.json()["allocation_id"]
            while (a := (await uc.get(f"/allocations/{aid}")).json())["status"] not in ("active", "failed"):
                await asyncio.sleep(0.005)
            elapsed = time.perf_counter() - t0
            assert a["status"] == "active", (driver, a.get("failure_reason"), f"see {root}/agent-{driver}.log")
            await uc.post(f"/allocations/{aid}/release")
            while (await uc.get(f"/allocations/{aid}")).json()["status"] != "released":
                await asyncio.sleep(0.02)
            return elapsed, a

        warm = {d: (await create_to_active(d))[1] for d in DRIVERS}  # the container host pulls the image
        assert warm["container"]["driver"] == "container" and warm["container"]["runtime"]["digest"] == runtime.digest
        assert warm["process"]["driver"] == "process" and warm["process"]["runtime"] is None
        latencies: dict[str, list[float]] = {d: [] for d in DRIVERS}
        for _ in range(latency_n):
            for d in DRIVERS:
                latencies[d].append((await create_to_active(d))[0])
        for h in hosts.values():
            await opc.post(f"/hosts/{h['host_id']}/cordon", json={"reason": "bench: placement run uses other hosts"})

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
        by_driver = {d: figures(latencies[d]) for d in DRIVERS}
        out = {
            "create_to_active": {
                **by_driver,
                "container_over_process": {
                    q: round(by_driver["container"][f"{q}_ms"] / by_driver["process"][f"{q}_ms"], 2)
                    for q in ("p50", "p99")
                },
                "goal": {"container_p50_ms": 1000, "container_p99_ms": 2000},
                "runtime": {"slug": RUNTIME, "digest": runtime.digest},
                "load_average": [round(x, 2) for x in os.getloadavg()],
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
        for proc in agent_procs:  # their long-polls would hold the server's graceful shutdown
            proc.terminate()
            proc.wait(30)
        server.should_exit = True
        await asyncio.wait_for(serve, 30)
    finally:
        for proc in agent_procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
        registry.stop()
        broker.stop()
        pg.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-n", type=int, default=20, help="allocations per driver")
    parser.add_argument("--concurrent", type=int, default=50)
    args = parser.parse_args()
    asyncio.run(main(args.latency_n, args.concurrent))
