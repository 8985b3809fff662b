"""What the catalog holds while it runs (set by the SPEC's startup hook, read with
`kit.state_as(CatalogRuntime)`): the registry client and the catalog's own counters."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter

from gpuaas.catalog.metrics import CatalogMetrics
from gpuaas.catalog.oci import RegistryClient
from gpuaas.catalog.settings import Settings
from gpuaas.kit.app import KitRuntime


@dataclass
class CatalogRuntime:
    registry: RegistryClient
    # Registry content verifications, by outcome ("verified" or the refusal's code).
    verifications: Counter
    # Artifact lifecycle moves, by target state.
    transitions: Counter


async def start_runtime(kit: KitRuntime) -> None:
    """Startup hook: the registry client from the settings, the counters of the app's metrics (`SPEC.metrics`)."""
    settings = kit.settings_as(Settings)
    metrics = kit.metrics.business_as(CatalogMetrics)
    kit.state = CatalogRuntime(
        registry=RegistryClient(
            settings.registry_plain_http, settings.registry_timeout_s, settings.registry_allowed_networks
        ),
        verifications=metrics.verifications,
        transitions=metrics.transitions,
    )
