"""What the catalog holds while it runs (set by the SPEC's startup hook, read with
`kit.state_as(CatalogRuntime)`): the registry client and the catalog's own counters."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter

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
    """Startup hook: the registry client from the settings, the counters on the app's registry."""
    settings = kit.settings_as(Settings)
    registry = kit.metrics.registry
    kit.state = CatalogRuntime(
        registry=RegistryClient(settings.registry_plain_http, settings.registry_timeout_s),
        verifications=Counter(
            "gpuaas_catalog_artifact_verifications_total",
            "Registry content verifications",
            ["outcome"],
            registry=registry,
        ),
        transitions=Counter(
            "gpuaas_catalog_artifact_transitions_total", "Artifact lifecycle moves", ["to"], registry=registry
        ),
    )
