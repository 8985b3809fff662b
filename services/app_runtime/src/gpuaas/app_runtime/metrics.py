"""The app_runtime service's business metrics (app instances, members, member operations and their
controller leases), on the app's registry (`SPEC.metrics`); the kit adds `service="app_runtime"`.

Gauges are computed from the tables at every scrape (same value on every replica: aggregate with `max`);
the lease-expiry counter is recorded by the use cases once their transaction commits (per process: `sum`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.app_runtime.models import instances, members, operations
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events.app_runtime import MemberStatus, OperationKind, OperationStatus
from gpuaas.kit.metrics import after_commit, metrics_of


class AppRuntimeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.operations = Gauge(
            "gpuaas_member_operations",
            "Member operations by kind and status (pending, claimed and in_progress are open)",
            ["kind", "status"],
            registry=registry,
        )
        self.instances = Gauge("gpuaas_app_instances", "App instances by status", ["status"], registry=registry)
        self.members = Gauge("gpuaas_app_members", "App instance members by status", ["status"], registry=registry)
        self.lease_expiries = Counter(
            "gpuaas_member_operation_lease_expiries_total",
            "Member operations requeued because their controller's lease ran out (crashed or hung controller)",
            registry=registry,
        )

    async def refresh(self, session: AsyncSession) -> None:
        ops = (
            await session.execute(
                select(operations.c.kind, operations.c.status, func.count()).group_by(
                    operations.c.kind, operations.c.status
                )
            )
        ).all()
        by_instance = dict(
            (await session.execute(select(instances.c.status, func.count()).group_by(instances.c.status))).all()
        )
        by_member = dict(
            (await session.execute(select(members.c.status, func.count()).group_by(members.c.status))).all()
        )
        counts = {(k.value, s.value): 0 for k in OperationKind for s in OperationStatus}
        for kind, status, n in ops:
            counts[(kind, status)] = n
        for (kind, status), n in counts.items():
            self.operations.labels(kind, status).set(n)
        for i in InstanceStatus:
            self.instances.labels(i.value).set(by_instance.get(i.value, 0))
        for m in MemberStatus:
            self.members.labels(m.value).set(by_member.get(m.value, 0))


def leases_expired(session: AsyncSession, n: int) -> None:
    """`n` operations whose lease ran out were requeued (counted once the transaction commits)."""
    if n and (m := metrics_of(session, AppRuntimeMetrics)):
        after_commit(session, lambda: m.lease_expiries.inc(n))
