"""Prometheus metrics, one registry per app (several apps can live in one test process).

Names follow Prometheus conventions: one name per measurement across services, `gpuaas_<thing>_<unit>`
(counters end in `_total`), and every sample carries a `service` label added by the app's registry
(`gpuaas_http_request_duration_seconds{service="billing",route="/prices",...}`), so one panel or one
alert covers every service. No metric name contains a service's name, and no metric may declare its
own `service` label (the registry refuses it).

A service adds its business metrics with `ServiceSpec.metrics`: a factory that registers them on the
app's registry and returns an object with `async refresh(session)`, called at every scrape to compute
gauges from the database. Use cases reach that object from their session (`metrics_of(session, T)`),
and `after_commit(session, fn)` records something only once the transaction has committed.

Gauges computed from the database report the same value on every replica: aggregate them with `max`
(not `sum`) across instances. Counters and histograms are per process: `sum` them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from sqlalchemy import event, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from gpuaas.kit.db import ServiceSession
from gpuaas.kit.tables import dead_letters, outbox

SERVICE_LABEL = "service"
PREFIX = "gpuaas_"
# session.info keys: the app's metrics, and what waits for the transaction's commit.
_INFO_METRICS = "gpuaas_metrics"
_INFO_PENDING = "gpuaas_metrics_after_commit"
# Seconds: a request or a consumer batch (HTTP latency, activation, rating delay up to an hour).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SLOW_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)

T = TypeVar("T")


class ServiceRegistry(CollectorRegistry):
    """A registry whose every sample carries `service=<name>`, added at collection."""

    def __init__(self, service: str) -> None:
        super().__init__(auto_describe=True)
        self.service = service

    def register(self, collector: Collector) -> None:
        labelnames: Iterable[str] = getattr(collector, "_labelnames", ())
        if SERVICE_LABEL in labelnames:
            raise ValueError(f"{collector!r}: the `{SERVICE_LABEL}` label is added by the registry; use another name")
        super().register(collector)

    def collect(self) -> Iterable[Metric]:
        for family in super().collect():
            labelled = copy.copy(family)
            labelled.samples = [s._replace(labels={SERVICE_LABEL: self.service, **s.labels}) for s in family.samples]
            yield labelled


class BusinessMetrics(Protocol):
    """What `ServiceSpec.metrics` builds: a service's own metrics, with gauges refreshed at scrape time."""

    async def refresh(self, session: AsyncSession) -> None: ...


class ServiceMetrics:
    """What the kit records for every service (HTTP, outbox relay, consumer, dead letters, readiness)."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = ServiceRegistry(service)
        self.business: object | None = None
        r = self.registry
        self.http_latency = Histogram(
            "gpuaas_http_request_duration_seconds",
            "HTTP request latency, by method, route template and status code",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.outbox_unsent = Gauge("gpuaas_outbox_pending_events", "Outbox rows not yet published", registry=r)
        self.outbox_lag_seconds = Gauge(
            "gpuaas_outbox_lag_seconds", "Age of the oldest unpublished outbox row (0 when none)", registry=r
        )
        self.relay_leader = Gauge(
            "gpuaas_relay_leader", "1 while this replica holds the outbox relay lock and publishes", registry=r
        )
        self.relay_restarts = Counter(
            "gpuaas_relay_restarts_total",
            "Relay publish loops restarted after a database, broker or unexpected error",
            registry=r,
        )
        self.events_published = Counter(
            "gpuaas_events_published_total", "Events published by the outbox relay", ["topic"], registry=r
        )
        self.events_applied = Counter(
            "gpuaas_events_applied_total", "Events applied by the consumer", ["topic", "type"], registry=r
        )
        self.events_duplicate = Counter(
            "gpuaas_events_duplicate_total", "Redelivered events skipped by the inbox", ["topic"], registry=r
        )
        self.consumer_lag = Gauge(
            "gpuaas_consumer_lag_messages",
            "Fetch high-water mark minus the consumer's position",
            ["topic", "partition"],
            registry=r,
        )
        self.consumer_progress = Gauge(
            "gpuaas_consumer_last_progress_timestamp_seconds",
            "Unix time the consumer last applied a batch or found nothing waiting (stalled when it ages)",
            ["group"],
            registry=r,
        )
        self.consumer_restarts = Counter(
            "gpuaas_consumer_restarts_total",
            "Consumer clients recreated after a broker error, a stall or a crash",
            registry=r,
        )
        self.dead_letters = Gauge(
            "gpuaas_dead_letters", "Parked (unresolved) dead letters in the service's table", registry=r
        )
        self.dead_lettered = Counter(
            "gpuaas_dead_lettered_total", "Events parked in the dead-letter table", ["topic"], registry=r
        )
        self.ready = Gauge(
            "gpuaas_ready",
            "Readiness checks of the service (1 passing, 0 failing), as /readyz answers them",
            ["check"],
            registry=r,
        )

    def business_as(self, cls: type[T]) -> T:
        """The service's business metrics (built by `ServiceSpec.metrics`), typed."""
        if not isinstance(self.business, cls):
            raise RuntimeError(f"{self.service}: business metrics are {type(self.business).__name__}, not {cls}")
        return self.business

    def session_info(self) -> dict[str, Any]:
        """The `info` every session of the app starts with: how use cases find these metrics."""
        return {_INFO_METRICS: self}

    async def refresh(self, session: AsyncSession) -> None:
        """Gauges the kit computes from the service's own tables at scrape time (every replica sees the
        same: the relay leader may be wedged, the table never lies)."""
        parked = await session.scalar(
            select(func.count()).select_from(dead_letters).where(dead_letters.c.status == "parked")
        )
        self.dead_letters.set(parked or 0)
        count, oldest, at = (
            await session.execute(
                select(func.count(), func.min(outbox.c.created_at), func.now()).where(outbox.c.sent_at.is_(None))
            )
        ).one()
        self.set_outbox_lag(count, oldest, at)
        refresh = getattr(self.business, "refresh", None)
        if refresh is not None:
            await refresh(session)

    def set_outbox_lag(self, count: int, oldest: datetime | None, at: datetime) -> None:
        self.outbox_unsent.set(count)
        self.outbox_lag_seconds.set(max((at - oldest).total_seconds(), 0.0) if oldest else 0.0)


def metrics_of(session: AsyncSession | Session, cls: type[T]) -> T | None:
    """The service's business metrics of type `cls` from a use case's session; None for a session the kit
    did not make (a test's own), so recording a metric never fails a use case."""
    m = session.info.get(_INFO_METRICS)
    if isinstance(m, ServiceMetrics) and isinstance(m.business, cls):
        return m.business
    return None


def after_commit(session: AsyncSession | Session, record: Callable[[], None]) -> None:
    """Run `record` (a counter's inc, a histogram's observe) once the session's transaction commits;
    never when it rolls back, so a retried transaction counts once."""
    session.info.setdefault(_INFO_PENDING, []).append(record)


@event.listens_for(ServiceSession, "after_commit")
def _run_pending(session: Session) -> None:
    for record in session.info.pop(_INFO_PENDING, []):
        try:
            record()
        except Exception:  # a metric must never fail a committed transaction's caller
            pass


@event.listens_for(ServiceSession, "after_rollback")
def _drop_pending(session: Session) -> None:
    session.info.pop(_INFO_PENDING, None)


def exposed_names(registry: CollectorRegistry) -> set[str]:
    """The metric family names a registry exposes (for tests and the naming check)."""
    return {family.name for family in registry.collect()}
