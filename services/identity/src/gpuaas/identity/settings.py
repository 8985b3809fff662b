"""Settings of the identity service (env prefix `GPUAAS_IDENTITY_`)."""

from gpuaas.kit.settings import ServiceSettings, service_config


class Settings(ServiceSettings):
    model_config = service_config("identity")

    service_name: str = "identity"
    port: int = 8001
