"""Settings of the allocations service (env prefix `GPUAAS_ALLOCATIONS_`)."""

from gpuaas.kit.settings import ServiceSettings, service_config


class Settings(ServiceSettings):
    model_config = service_config("allocations")

    service_name: str = "allocations"
    port: int = 8002
