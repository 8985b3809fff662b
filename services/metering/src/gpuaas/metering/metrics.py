"""Metering's business metrics (meters and the usage records it produces), on the app's registry
(`SPEC.metrics`); the kit adds `service="metering"` to each sample.

`gpuaas_meters{status}` is computed at scrape time (same on every replica: aggregate with `max`); a meter
is `suspended` while its host's heartbeats are lost. `gpuaas_usage_records_emitted_total{kind}` is counted
by the use cases once their transaction commits (per process: `sum`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.kit.metrics import after_commit, metrics_of
from gpuaas.metering.models import meters

METER_STATUSES = ("open", "suspended", "closed")


class MeteringMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.meters = Gauge(
            "gpuaas_meters",
            "Allocation meters by status (suspended: the host's heartbeats are lost, no GPU time accrues)",
            ["status"],
            registry=registry,
        )
        self.emitted = Counter(
            "gpuaas_usage_records_emitted_total",
            "Usage records written and published (gpu: closed hourly windows; app: app usage posted), by kind",
            ["kind"],
            registry=registry,
        )

    async def refresh(self, session: AsyncSession) -> None:
        rows = dict((await session.execute(select(meters.c.status, func.count()).group_by(meters.c.status))).all())
        for status in METER_STATUSES:
            self.meters.labels(status).set(rows.get(status, 0))


def usage_emitted(session: AsyncSession, kind: str, n: int) -> None:
    """`n` usage records of `kind` were written (counted once the transaction commits)."""
    if n and (m := metrics_of(session, MeteringMetrics)):
        after_commit(session, lambda: m.emitted.labels(kind).inc(n))
