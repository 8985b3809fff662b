"""The backup and restore procedure of docs/operations.md, run for real: billing and metering on a real Postgres
and broker, their schemas dumped with pg_dump, more usage billed, the schemas dropped and restored with
pg_restore, then caught up by replaying the outbox of the services they consume from since the dump.

1. billing: restored from the dump, it lacks every charge made after it. `python -m gpuaas.metering replay
   --since <dump time>` (the real command line) makes metering's relay publish those usage events again;
   billing, whose inbox came back with the dump, rates exactly the missing ones: the ledger balances and every
   total equals the one before the drop.
2. metering: restored from the same dump, it lacks the meter and usage of the allocation that ran after it.
   Allocations' outbox replay since the dump (the same events again, the same ids, as its relay republishes
   them; allocations itself does not run here) makes metering derive the same usage records (their ids are
   fixed by allocation and window) and publish them again; billing takes them as duplicates: nothing is
   charged twice.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from gpuaas.billing.app import SPEC as BILLING
from gpuaas.contracts.enums import AllocationStatus, CapacityShape
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.devstack.infra import _pg_bin
from gpuaas.kit.app import ServiceSpec, create_app
from gpuaas.kit.db import to_plain_url
from gpuaas.kit.testing import key_settings, new_service_db, running, wait_for
from gpuaas.kit.testing_events import apply_events, platform_admin, project_created, publish, tenant_created
from gpuaas.metering.app import SPEC as METERING

pytestmark = pytest.mark.integration
HOUR = timedelta(hours=1)


# ----------------------------------------------------------------------------------------------- services


class Service:
    """One service on its own schema: started, stopped and started again on the same schema and group."""

    def __init__(self, spec: ServiceSpec, schema: str, url: str, bootstrap: str, **overrides: Any) -> None:
        self.spec, self.schema, self.url = spec, schema, url
        self.settings = spec.settings_cls(
            database_url=url,
            db_schema=schema,
            kafka_bootstrap=bootstrap,
            consumer_group=schema,
            jwt_issuer="http://test-issuer/api/identity",
            outbox_poll_interval_s=0.5,
            log_json=False,
            **{**key_settings(spec.name), **overrides},  # the test keys (secrets at rest, event signatures)
        )

    @asynccontextmanager
    async def serving(self, signer: Any) -> AsyncIterator[Any]:
        async with running(create_app(self.settings, self.spec), jwks=signer.jwks) as (client, kit):
            yield client, kit

    def env(self) -> dict[str, str]:
        prefix = f"GPUAAS_{self.spec.name.upper()}_"
        return {**os.environ, f"{prefix}DATABASE_URL": self.url, f"{prefix}DB_SCHEMA": self.schema}


async def new_service(spec: ServiceSpec, infra: Any, **overrides: Any) -> Service:
    schema, url = await new_service_db(infra.admin_url, spec.name, spec)
    return Service(spec, schema, url, infra.kafka_bootstrap, **overrides)


# --------------------------------------------------------------------------------------- backup / restore


def pg_dump(svc: Service, path: Path) -> None:
    """A custom-format dump of the service's schema, taken as the service's own role (it owns everything in it)."""
    subprocess.run(
        [
            str(_pg_bin() / "pg_dump"),
            "--format=custom",
            f"--schema={svc.schema}",
            f"--file={path}",
            f"--dbname={to_plain_url(svc.url)}",
        ],
        check=True,
        capture_output=True,
    )


def pg_restore(admin_url: str, path: Path) -> None:
    """Restore a dropped schema as the superuser: the schema and its objects come back owned by the role."""
    subprocess.run(
        [str(_pg_bin() / "pg_restore"), "--exit-on-error", f"--dbname={admin_url}", str(path)],
        check=True,
        capture_output=True,
    )


async def sql(admin_url: str, query: str, *args: Any) -> Any:
    conn = await asyncpg.connect(admin_url)
    try:
        return await conn.fetch(query, *args)
    finally:
        await conn.close()


async def drop_schema(admin_url: str, schema: str) -> None:
    await sql(admin_url, f"DROP SCHEMA {schema} CASCADE")
    assert not await sql(admin_url, "SELECT 1 FROM pg_namespace WHERE nspname = $1", schema)


def replay(svc: Service, since: datetime) -> str:
    """The operator's command: `python -m gpuaas.<service> replay --since <ISO time>`."""
    done = subprocess.run(
        [sys.executable, "-m", f"gpuaas.{svc.spec.name}", "replay", "--since", since.isoformat()],
        env=svc.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# ------------------------------------------------------------------------------------------------ figures


async def billing_figures(admin_url: str, schema: str, tenant: uuid.UUID) -> dict[str, Any]:
    """The tenant's charges and ledger, and the whole ledger's balance."""
    (charges,) = await sql(
        admin_url,
        f"SELECT count(*) AS n, coalesce(sum(amount), 0) AS total FROM {schema}.charges WHERE tenant_id = $1",
        tenant,
    )
    (ledger,) = await sql(
        admin_url,
        f"SELECT count(DISTINCT t.transaction_id) AS txns, "
        f"coalesce(sum(e.amount) FILTER (WHERE e.side = 'debit'), 0) AS debits, "
        f"coalesce(sum(e.amount) FILTER (WHERE e.side = 'credit'), 0) AS credits "
        f"FROM {schema}.ledger_transactions t JOIN {schema}.ledger_entries e USING (transaction_id) "
        f"WHERE t.tenant_id = $1",
        tenant,
    )
    unbalanced = await sql(
        admin_url,
        f"SELECT transaction_id FROM {schema}.ledger_entries GROUP BY transaction_id, currency "
        f"HAVING sum(amount) FILTER (WHERE side = 'debit') IS DISTINCT FROM sum(amount) FILTER (WHERE side = 'credit')",
    )
    return {
        "charges": charges["n"],
        "total": Decimal(charges["total"]),
        "transactions": ledger["txns"],
        "debits": Decimal(ledger["debits"]),
        "credits": Decimal(ledger["credits"]),
        "unbalanced": len(unbalanced),
    }


async def usage_figures(admin_url: str, schema: str, tenant: uuid.UUID) -> tuple[int, Decimal]:
    (row,) = await sql(
        admin_url,
        f"SELECT count(*) AS n, coalesce(sum(gpu_seconds), 0) AS s FROM {schema}.usage_records WHERE tenant_id = $1",
        tenant,
    )
    return row["n"], Decimal(row["s"])


# ------------------------------------------------------------------------------------------------- events


def allocation_run(
    tenant: uuid.UUID, project: uuid.UUID, activated: datetime, minutes: int, gpus: int
) -> list[allocation_events.AllocationActivated | allocation_events.AllocationReleaseRequested]:
    """An allocation's activation and release request, as allocations publishes them."""
    state = allocation_events.AllocationState(
        allocation_id=uuid.uuid4(),
        tenant_id=tenant,
        project_id=project,
        shape=CapacityShape.gpu_slice,
        gpu_model="H100-80GB",
        gpu_count=gpus,
        host_id=uuid.uuid4(),
        status=AllocationStatus.active,
        status_changed_at=activated,
        requested_at=activated - timedelta(minutes=1),
        activated_at=activated,
        version=3,
    )
    stop = activated + timedelta(minutes=minutes)
    released = state.model_copy(
        update={
            "status": AllocationStatus.releasing,
            "status_changed_at": stop,
            "release_requested_at": stop,
            "billing_stopped_at": stop,
            "release_attempts": 1,
            "version": 4,
        }
    )
    return [
        allocation_events.AllocationActivated.build(data=state, source="allocations"),
        allocation_events.AllocationReleaseRequested.build(data=released, source="allocations"),
    ]


async def is_(value: Any, expected: Any) -> bool:
    return (await value) == expected


# --------------------------------------------------------------------------------------------------- test


async def test_schemas_restored_from_a_dump_catch_up_by_outbox_replay(infra, signer, tmp_path) -> None:
    admin = infra.admin_url
    tenant, project, op = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    world = [platform_admin(op), tenant_created(tenant, "bk"), project_created(project, tenant, "bk")]
    metering = await new_service(METERING, infra, window_settle_s=0.0, closer_interval_s=3600.0)
    billing = await new_service(BILLING, infra)
    base = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - 6 * HOUR
    before = allocation_run(tenant, project, base + timedelta(minutes=10), minutes=100, gpus=2)
    after = allocation_run(tenant, project, base + 3 * HOUR + timedelta(minutes=5), minutes=75, gpus=4)

    def billed(gpu_seconds: int) -> Any:
        """True once metering recorded this much of the tenant's usage and billing charged every record of it."""

        async def check() -> bool:
            n, seconds = await usage_figures(admin, metering.schema, tenant)
            return seconds == gpu_seconds and (await billing_figures(admin, billing.schema, tenant))["charges"] == n

        return check

    async with metering.serving(signer) as (_, m_kit), billing.serving(signer) as (b_client, b_kit):
        await apply_events(m_kit, *world)
        await apply_events(b_kit, *world)
        r = await b_client.post(
            "/prices",
            json={
                "unit": "gpu_hour",
                "unit_price": "2.50",
                "currency": "USD",
                "gpu_model": "H100-80GB",
                "shape": "gpu_slice",
                "effective_from": (base - timedelta(days=40)).isoformat(),
            },
            headers={"Authorization": f"Bearer {signer.token(op)}"},
        )
        assert r.status_code == 201, r.text
        await publish(infra.kafka_bootstrap, before)
        await wait_for(billed(2 * 100 * 60), 60, "usage before the dump billed")
        at_dump = await billing_figures(admin, billing.schema, tenant)
        usage_at_dump = await usage_figures(admin, metering.schema, tenant)

        # The backup: both schemas, while the services run. Replay from a little before it (replaying too much
        # is safe: consumers dedupe).
        dumped_at = datetime.now(UTC) - timedelta(seconds=5)
        pg_dump(billing, tmp_path / "billing.dump")
        pg_dump(metering, tmp_path / "metering.dump")

        await publish(infra.kafka_bootstrap, after)
        await wait_for(billed(2 * 100 * 60 + 4 * 75 * 60), 60, "usage after the dump billed")
    final = await billing_figures(admin, billing.schema, tenant)
    final_usage = await usage_figures(admin, metering.schema, tenant)
    # Two GPUs for 100 minutes, then four for 75: 30,000 GPU-seconds, 8.33 GPU-hours at 2.50 (charges round each).
    assert final_usage[1] == Decimal(2 * 100 * 60 + 4 * 75 * 60)
    assert abs(final["total"] - Decimal("2.50") * final_usage[1] / 3600) < Decimal("0.00001")
    assert final["unbalanced"] == 0 and final["debits"] == final["credits"] > at_dump["debits"]
    assert final["charges"] > at_dump["charges"] and final_usage[0] > usage_at_dump[0]

    # 1. billing's schema is lost and restored from the dump: it is back to what it was at the dump.
    await drop_schema(admin, billing.schema)
    pg_restore(admin, tmp_path / "billing.dump")
    assert await billing_figures(admin, billing.schema, tenant) == at_dump
    async with metering.serving(signer), billing.serving(signer) as (b_client, _):
        requeued = replay(metering, dumped_at)
        assert requeued.startswith("requeued ") and int(requeued.split()[1]) >= final_usage[0] - usage_at_dump[0]
        await wait_for(lambda: is_(billing_figures(admin, billing.schema, tenant), final), 60, "billing caught up")
        r = await b_client.get("/ledger/balance", headers={"Authorization": f"Bearer {signer.token(op)}"})
        assert r.status_code == 200 and r.json()["balanced"] is True and r.json()["unbalanced_transactions"] == 0

    # 2. metering's schema is lost and restored from the same dump: the allocation that ran after it is gone.
    await drop_schema(admin, metering.schema)
    pg_restore(admin, tmp_path / "metering.dump")
    assert await usage_figures(admin, metering.schema, tenant) == usage_at_dump
    (last,) = await sql(admin, f"SELECT coalesce(max(seq), 0) AS seq FROM {metering.schema}.outbox")
    async with metering.serving(signer), billing.serving(signer):
        # Allocations' outbox replay since the dump: the same events again.
        await publish(infra.kafka_bootstrap, after)
        await wait_for(
            lambda: is_(usage_figures(admin, metering.schema, tenant), final_usage), 60, "metering caught up"
        )
        # Metering published the re-derived usage again (new event ids): wait until billing consumed all of it.
        rederived = await sql(
            admin,
            f"SELECT event_id FROM {metering.schema}.outbox "
            f"WHERE event_type = 'usage.recorded' AND aggregate_id = $1 AND seq > $2",
            str(after[0].data.allocation_id),
            last["seq"],
        )
        assert len(rederived) == final_usage[0] - usage_at_dump[0]
        ids = [r["event_id"] for r in rederived]

        async def consumed() -> bool:
            rows = await sql(admin, f"SELECT count(*) AS n FROM {billing.schema}.inbox WHERE event_id = ANY($1)", ids)
            return rows[0]["n"] == len(ids)

        await wait_for(consumed, 60, "billing consumed the re-derived usage")
        assert await billing_figures(admin, billing.schema, tenant) == final
