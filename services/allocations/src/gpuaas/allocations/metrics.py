"""The allocations service's business metrics (the facts it owns: GPU capacity, hosts, allocations,
placement), on the app's registry (`SPEC.metrics`); the kit adds `service="allocations"` to each sample.

Gauges are computed from the tables at every scrape (`refresh`), so every replica reports the same
value: aggregate them with `max`, not `sum`. Counters and the histogram are recorded by the use cases
(`refused`, `activated`, `heartbeat_lost`), per process: `sum` them.
"""

from __future__ import annotations

from datetime import datetime

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.allocations.models import allocations, gpu_assignments, hosts
from gpuaas.allocations.queue_usage import configured_usage, waiting_by_reason
from gpuaas.contracts.enums import AllocationStatus
from gpuaas.contracts.events.allocations import HostStatus
from gpuaas.kit.metrics import SLOW_BUCKETS, after_commit, metrics_of

# The label of hosts (and their GPUs) enrolled without a host class.
NO_CLASS = "none"


class AllocationsMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.gpus = Gauge(
            "gpuaas_gpus",
            "GPUs of hosts that are not decommissioned, by host class and state: used (held by an allocation), "
            "free (unheld on a ready host) or unavailable (unheld on an enrolling, cordoned or unreachable host); "
            "the states sum to the total",
            ["host_class", "state"],
            registry=registry,
        )
        self.hosts = Gauge(
            "gpuaas_hosts", "Hosts by host class and status", ["host_class", "status"], registry=registry
        )
        self.allocations = Gauge("gpuaas_allocations", "Allocations by status", ["status"], registry=registry)
        self.placement_refusals = Counter(
            "gpuaas_placement_refusals_total",
            "Allocation creates and resizes refused for capacity or quota, by reason (the problem's code)",
            ["reason"],
            registry=registry,
        )
        self.activation = Histogram(
            "gpuaas_allocation_activation_seconds",
            "Time from an allocation's request (create) to active",
            buckets=SLOW_BUCKETS,
            registry=registry,
        )
        # The capacity queue (issue 29), per pool (GPU model).
        self.waiting = Gauge(
            "gpuaas_capacity_waiting_requests",
            "Requests waiting for capacity (queued allocations and resizes up that wait), by GPU model (pool) and "
            "pending reason",
            ["gpu_model", "reason"],
            registry=registry,
        )
        self.wait = Histogram(
            "gpuaas_capacity_wait_seconds",
            "Time a queued allocation waited before admission, by GPU model",
            ["gpu_model"],
            buckets=(0.1, 0.5, *SLOW_BUCKETS),
            registry=registry,
        )
        self.admissions = Counter(
            "gpuaas_capacity_admissions_total",
            "Queued allocations admitted (placed and provisioning) by the admission runner, by GPU model",
            ["gpu_model"],
            registry=registry,
        )
        self.preemptions = Counter(
            "gpuaas_capacity_preemptions_total",
            "Preemptions by GPU model and step: scheduled (notice given), stopped at the deadline, called off",
            ["gpu_model", "step"],
            registry=registry,
        )
        # Per queue with settings (bounded by the capacity_queues rows; queue = the tenant or project id).
        queue_labels = ["gpu_model", "scope", "queue"]
        self.queue_guarantee = Gauge(
            "gpuaas_capacity_queue_guarantee_gpus",
            "GPUs a capacity queue is guaranteed, by GPU model, scope (tenant or project) and queue (the scope's id)",
            queue_labels,
            registry=registry,
        )
        self.queue_held = Gauge(
            "gpuaas_capacity_queue_held_gpus",
            "GPUs a capacity queue holds now (a resize up in flight at its target)",
            queue_labels,
            registry=registry,
        )
        self.queue_waiting = Gauge(
            "gpuaas_capacity_queue_waiting_requests",
            "Requests of a capacity queue waiting for capacity (queued allocations and resizes up that wait)",
            queue_labels,
            registry=registry,
        )
        self.queue_below_guarantee = Gauge(
            "gpuaas_capacity_queue_below_guarantee",
            "1 when a capacity queue has waiting requests and holds fewer GPUs than its guarantee, else 0",
            queue_labels,
            registry=registry,
        )
        self.heartbeat_losses = Counter(
            "gpuaas_host_heartbeat_losses_total",
            "Hosts marked unreachable because their agent stopped heartbeating",
            registry=registry,
        )

    async def refresh(self, session: AsyncSession) -> None:

        host_rows = (
            await session.execute(
                select(hosts.c.host_id, hosts.c.host_class, hosts.c.status, func.jsonb_array_length(hosts.c.gpus))
            )
        ).all()
        held = dict(
            (
                await session.execute(
                    select(gpu_assignments.c.host_id, func.count()).group_by(gpu_assignments.c.host_id)
                )
            ).all()
        )
        by_status = dict(
            (await session.execute(select(allocations.c.status, func.count()).group_by(allocations.c.status))).all()
        )
        queued = await waiting_by_reason(session)
        queues = await configured_usage(session)
        gpus: dict[tuple[str, str], int] = {}
        host_counts: dict[tuple[str, str], int] = {}
        for host_id, host_class, status, total in host_rows:
            cls = host_class or NO_CLASS
            host_counts[(cls, status)] = host_counts.get((cls, status), 0) + 1
            if status == HostStatus.decommissioned:
                continue
            used = held.get(host_id, 0)
            idle = "free" if status == HostStatus.ready else "unavailable"
            for state in ("used", "free", "unavailable"):
                gpus.setdefault((cls, state), 0)
            gpus[(cls, "used")] += used
            gpus[(cls, idle)] += max((total or 0) - used, 0)
        # No await from here on: a concurrent scrape never sees the gauges half cleared.
        self.gpus.clear()
        for (cls, state), n in gpus.items():
            self.gpus.labels(cls, state).set(n)
        self.hosts.clear()
        for (cls, status), n in host_counts.items():
            self.hosts.labels(cls, status).set(n)
        for status in AllocationStatus:
            self.allocations.labels(status.value).set(by_status.get(status.value, 0))
        self.waiting.clear()
        for model, reason, n in queued:
            self.waiting.labels(model, reason).set(n)
        for gauge in (self.queue_guarantee, self.queue_held, self.queue_waiting, self.queue_below_guarantee):
            gauge.clear()
        for u in queues:
            labels = (u.gpu_model, u.scope, str(u.scope_id))
            self.queue_guarantee.labels(*labels).set(u.guarantee)
            self.queue_held.labels(*labels).set(u.held)
            self.queue_waiting.labels(*labels).set(u.waiting)
            self.queue_below_guarantee.labels(*labels).set(int(u.waiting > 0 and u.held < u.guarantee))


def refused(session: AsyncSession, reason: str) -> None:
    """A create or resize refused for capacity or quota (counted at once: the transaction rolls back)."""
    if m := metrics_of(session, AllocationsMetrics):
        m.placement_refusals.labels(reason).inc()


def activated(session: AsyncSession, requested_at: datetime, activated_at: datetime) -> None:
    """An allocation became active for the first time: its create→active time, once the change commits."""
    if m := metrics_of(session, AllocationsMetrics):
        seconds = max((activated_at - requested_at).total_seconds(), 0.0)
        after_commit(session, lambda: m.activation.observe(seconds))


def heartbeat_lost(session: AsyncSession, hosts_lost: int) -> None:
    if hosts_lost and (m := metrics_of(session, AllocationsMetrics)):
        after_commit(session, lambda: m.heartbeat_losses.inc(hosts_lost))


def admitted(session: AsyncSession, gpu_model: str, waited_s: float) -> None:
    """A queued allocation admitted: its wait, counted once the admission commits."""
    if m := metrics_of(session, AllocationsMetrics):

        def record() -> None:
            m.admissions.labels(gpu_model).inc()
            m.wait.labels(gpu_model).observe(waited_s)

        after_commit(session, record)


def preemption(session: AsyncSession, gpu_model: str, step: str) -> None:
    """A preemption scheduled, stopped or called off (issue 29), counted once the step commits."""
    if m := metrics_of(session, AllocationsMetrics):
        after_commit(session, lambda: m.preemptions.labels(gpu_model, step).inc())
