"""Prometheus metrics, one registry per app (several apps can live in one test process).

Names follow `gpuaas_<service>_<thing>_<unit>`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServiceMetrics:
    def __init__(self, service: str) -> None:
        self.registry = CollectorRegistry()
        p = f"gpuaas_{service}"
        r = self.registry
        self.http_latency = Histogram(
            f"{p}_http_request_duration_seconds",
            "HTTP request latency",
            ["method", "route", "status"],
            registry=r,
        )
        self.outbox_unsent = Gauge(f"{p}_outbox_lag_events", "Outbox rows not yet published", registry=r)
        self.outbox_lag_seconds = Gauge(
            f"{p}_outbox_lag_seconds", "Age of the oldest unpublished outbox row", registry=r
        )
        self.events_published = Counter(
            f"{p}_events_published_total", "Events published by the relay", ["topic"], registry=r
        )
        self.events_applied = Counter(
            f"{p}_events_applied_total", "Events applied by consumers", ["topic", "type"], registry=r
        )
        self.events_duplicate = Counter(
            f"{p}_events_duplicate_total", "Redelivered events skipped by the inbox", ["topic"], registry=r
        )
        self.consumer_lag = Gauge(
            f"{p}_consumer_lag_messages", "High-water mark minus position", ["topic", "partition"], registry=r
        )
        self.consumer_restarts = Counter(
            f"{p}_consumer_restarts_total", "Consumers recreated after a broker error, stall or crash", registry=r
        )
        self.dead_letters = Gauge(f"{p}_dead_letters", "Parked (unresolved) dead letters", registry=r)
        self.dead_lettered = Counter(
            f"{p}_dead_lettered_total", "Events parked in the dead-letter table", ["topic"], registry=r
        )
