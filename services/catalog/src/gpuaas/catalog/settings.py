"""Settings of the catalog service (env prefix `GPUAAS_CATALOG_`)."""

from gpuaas.catalog import SERVICE
from gpuaas.kit.settings import ServiceSettings, service_config


class Settings(ServiceSettings):
    model_config = service_config(SERVICE)

    service_name: str = SERVICE
    port: int = 8003

    # Registries reached over plain HTTP (loopback dev/test registries); everything else is HTTPS.
    registry_plain_http: list[str] = ["127.0.0.1", "localhost", "[::1]"]
    registry_timeout_s: float = 30.0
    # CIDRs a registry's redirect (to its blob storage, another host) may lead to although denied by default
    # (loopback, private, link-local, shared, multicast, reserved: gpuaas.kit.outbound). Default: none.
    registry_allowed_networks: list[str] = []
