"""The controller's Prometheus metrics, in a registry of its own (served at `/metrics` by the runner)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.operations = Counter(
            "gpuaas_controller_operations",
            "Member operations handled, by kind and outcome",
            ["kind", "outcome"],
            registry=r,
        )
        self.operation_seconds = Histogram(
            "gpuaas_controller_operation_seconds", "Time from claim to report", ["kind"], registry=r
        )
        self.temporary_retries = Counter(
            "gpuaas_controller_temporary_retries", "Handler runs repeated after a TemporaryError", registry=r
        )
        self.reconciles = Counter(
            "gpuaas_controller_reconciles", "Reconciles of an instance, by outcome", ["outcome"], registry=r
        )
        self.claim_polls = Counter(
            "gpuaas_controller_claim_polls", "Claim requests, by result (claimed, idle, error)", ["result"], registry=r
        )
        self.operations_in_flight = Gauge(
            "gpuaas_controller_operations_in_flight", "Operations this replica works on now", registry=r
        )
        self.queue_depth = Gauge("gpuaas_controller_queue_depth", "Instances queued for reconcile", registry=r)
        self.last_contact = Gauge(
            "gpuaas_controller_last_contact_timestamp_seconds", "When the platform last answered", registry=r
        )
