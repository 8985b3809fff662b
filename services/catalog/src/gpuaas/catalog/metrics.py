"""The catalog's business metrics (artifact trust and promotion), on the app's registry (`SPEC.metrics`);
the kit adds `service="catalog"`. The artifacts gauge is computed at every scrape (same on every replica:
aggregate with `max`); the counters are recorded by the trust use cases (per process: `sum`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.catalog.models import artifacts
from gpuaas.contracts.events.catalog import ArtifactLifecycle


class CatalogMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        # Registry content verifications, by outcome ("verified" or the refusal's code).
        self.verifications = Counter(
            "gpuaas_artifact_verifications_total", "Registry content verifications", ["outcome"], registry=registry
        )
        # Artifact lifecycle moves, by target state.
        self.transitions = Counter(
            "gpuaas_artifact_transitions_total", "Artifact lifecycle moves", ["to"], registry=registry
        )
        self.artifacts = Gauge("gpuaas_artifacts", "Artifacts by lifecycle state", ["state"], registry=registry)

    async def refresh(self, session: AsyncSession) -> None:
        rows = dict((await session.execute(select(artifacts.c.state, func.count()).group_by(artifacts.c.state))).all())
        for state in ArtifactLifecycle:
            self.artifacts.labels(state.value).set(rows.get(state.value, 0))
