"""Metric naming across every service (issue 16): one name per measurement with a `service` label, no
service name inside a metric name, Prometheus suffix conventions; the kit's scrape-time gauges, the
readiness gauge and `after_commit` on a real app (real Postgres and broker)."""

from __future__ import annotations

import importlib
import re
import uuid
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import insert, text

from gpuaas.contracts.registry import AUDIT
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.metrics import SERVICE_LABEL, ServiceMetrics, ServiceRegistry, after_commit, metrics_of
from gpuaas.kit.outbox import add_events
from gpuaas.kit.tables import dead_letters
from gpuaas.kit.testing import build, new_service_db, running

from .test_outbox_inbox import audit_event

SERVICES = ["identity", "allocations", "catalog", "app_runtime", "metering", "billing", "gateway"]
NAME = re.compile(r"^gpuaas_[a-z][a-z0-9_]*$")
# No metric name may start with `gpuaas_<service>_` (the service is a label); `gpuaas_allocations`, the count of
# allocations, is a measurement, not a namespace.
SERVICE_WORDS = {"identity", "allocations", "catalog", "app_runtime", "metering", "billing", "gateway"}


def registry_of(service: str) -> CollectorRegistry:
    """The registry a service's app exposes at /metrics: the kit's metrics plus its business metrics."""
    if service == "gateway":
        from gpuaas.gateway.runtime import GatewayMetrics

        return GatewayMetrics().service.registry
    spec = importlib.import_module(f"gpuaas.{service}.app").SPEC
    metrics = ServiceMetrics(spec.name)
    if spec.metrics is not None:
        metrics.business = spec.metrics(metrics.registry)
    return metrics.registry


def families(registry: CollectorRegistry) -> dict[str, Any]:
    """Families by name with their type, as a scraper reads them (samples included)."""
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


@pytest.mark.parametrize("service", SERVICES)
def test_every_metric_follows_the_naming_rules(service: str) -> None:
    registry = registry_of(service)
    for family in registry.collect():
        assert NAME.match(family.name), family.name
        for word in SERVICE_WORDS:  # the old `gpuaas_<service>_...` namespace: one name per service
            assert not family.name.startswith(f"gpuaas_{word}_"), f"{family.name}: use the service label"
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), f"histogram {family.name} needs its unit"
        if family.type == "gauge":
            assert not family.name.endswith("_total"), f"gauge {family.name} must not end in _total"
        for sample in family.samples:
            assert sample.labels[SERVICE_LABEL] == service, (family.name, sample.labels)


def test_one_name_means_one_measurement_across_services() -> None:
    """The same name in two services has the same type and help (one panel, one alert for all)."""
    seen: dict[str, tuple[str, str, str]] = {}
    for service in SERVICES:
        for family in registry_of(service).collect():
            if family.name in seen:
                other, typ, doc = seen[family.name]
                assert (family.type, family.documentation) == (typ, doc), (family.name, service, other)
            else:
                seen[family.name] = (service, family.type, family.documentation)
    kit = set(families(ServiceMetrics("x").registry))
    shared = {name for name, (_, _, _) in seen.items() if name in kit}
    assert {"gpuaas_http_request_duration_seconds", "gpuaas_outbox_lag_seconds", "gpuaas_dead_letters"} <= shared


def test_business_metrics_are_exported_by_the_service_that_owns_the_fact() -> None:
    owners = {
        "allocations": {
            "gpuaas_gpus",
            "gpuaas_hosts",
            "gpuaas_allocations",
            "gpuaas_placement_refusals",
            "gpuaas_allocation_activation_seconds",
            "gpuaas_host_heartbeat_losses",
        },
        "app_runtime": {"gpuaas_member_operations", "gpuaas_member_operation_lease_expiries"},
        "catalog": {"gpuaas_artifact_verifications", "gpuaas_artifact_transitions"},
        "gateway": {"gpuaas_upstream_requests", "gpuaas_rate_limited"},
    }
    for service, names in owners.items():
        exposed = {f.name for f in registry_of(service).collect()}
        assert names <= exposed, (service, names - exposed)
        for other in set(SERVICES) - {service}:
            assert not names & {f.name for f in registry_of(other).collect()}, (other, names)


def test_the_registry_refuses_a_service_label_of_its_own() -> None:
    registry = ServiceRegistry("billing")
    with pytest.raises(ValueError, match="service"):
        Counter("gpuaas_things_total", "things", ["service"], registry=registry)
    Counter("gpuaas_things_total", "things", ["upstream"], registry=registry).labels("catalog").inc()
    text_out = generate_latest(registry).decode()
    assert 'gpuaas_things_total{service="billing",upstream="catalog"} 1.0' in text_out


# --------------------------------------------------------------------------- on a real app


class Things:
    """A stand-in service's business metrics: a counter bumped after commit, a gauge from its table."""

    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Gauge

        self.made = Counter("gpuaas_things_made_total", "things made", registry=registry)
        self.stored = Gauge("gpuaas_things_stored", "things in the table", registry=registry)

    async def refresh(self, session: Any) -> None:
        self.stored.set((await session.execute(text("SELECT count(*) FROM things"))).scalar_one())


def sample(body: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


async def test_scrape_time_gauges_readiness_and_after_commit(infra: Any) -> None:
    name, url = await new_service_db(infra.admin_url, "metrics")
    app = build(name, url, infra.kafka_bootstrap, with_iam=False, metrics=Things, settings={"run_relay": False})
    async with running(app) as (client, kit):
        kit_rt: KitRuntime = kit
        things = kit_rt.metrics.business_as(Things)
        async with kit_rt.sessions() as s, s.begin():
            await s.execute(text("CREATE TABLE things (id uuid primary key)"))
        # committed: counted once; rolled back: never
        async with kit_rt.sessions() as s, s.begin():
            await s.execute(text("INSERT INTO things VALUES (:i)"), {"i": uuid.uuid4()})
            m = metrics_of(s, Things)
            assert m is things
            after_commit(s, m.made.inc)
            assert things.made._value.get() == 0  # not before the commit
        with pytest.raises(RuntimeError):
            async with kit_rt.sessions() as s, s.begin():
                await s.execute(text("INSERT INTO things VALUES (:i)"), {"i": uuid.uuid4()})
                after_commit(s, things.made.inc)
                raise RuntimeError("roll back")
        # the relay is off: three unpublished outbox rows, the oldest of a known age
        async with kit_rt.sessions() as s, s.begin():
            await add_events(s, [audit_event(name, f"agg-{i}", i) for i in range(3)])
            oldest = (
                "UPDATE outbox SET created_at = now() - interval '90 seconds' WHERE seq = (SELECT min(seq) FROM outbox)"
            )
            await s.execute(text(oldest))
            await s.execute(
                insert(dead_letters).values(
                    id=uuid.uuid4(),
                    consumer=name,
                    topic=AUDIT,
                    partition=0,
                    offset=1,
                    payload=b"{}",
                    error="boom",
                    attempts=3,
                )
            )
        assert (await client.get("/readyz")).status_code == 200  # the probe sets gpuaas_ready{check}
        body = (await client.get("/metrics")).text
        assert sample(body, "gpuaas_things_made_total", service=name) == 1.0
        assert sample(body, "gpuaas_things_stored", service=name) == 1.0
        assert sample(body, "gpuaas_outbox_pending_events", service=name) == 3.0
        lag = sample(body, "gpuaas_outbox_lag_seconds", service=name)
        assert lag is not None and 89 <= lag < 150
        assert sample(body, "gpuaas_dead_letters", service=name) == 1.0
        assert sample(body, "gpuaas_ready", service=name, check="database") == 1.0
        assert sample(body, "gpuaas_ready", service=name, check="broker") == 1.0
        # the HTTP histogram of the scrape before, by route template
        assert sample(body, "gpuaas_http_request_duration_seconds_count", service=name, route="/metrics") is None
        body = (await client.get("/metrics")).text
        assert sample(body, "gpuaas_http_request_duration_seconds_count", service=name, route="/metrics") == 1.0
        # a session the kit did not make records nothing and fails nothing
        assert metrics_of(_ForeignSession(), Things) is None


class _ForeignSession:
    info: dict[str, Any] = {}
