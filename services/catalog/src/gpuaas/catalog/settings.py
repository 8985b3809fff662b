"""Settings of the catalog service (env prefix `GPUAAS_CATALOG_`)."""

from gpuaas.kit.settings import ServiceSettings, service_config


class Settings(ServiceSettings):
    model_config = service_config("catalog")

    service_name: str = "catalog"
    port: int = 8003
