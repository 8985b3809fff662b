"""Settings of the metering service (env prefix `GPUAAS_METERING_`)."""

from gpuaas.kit.settings import ServiceSettings, service_config


class Settings(ServiceSettings):
    model_config = service_config("metering")

    service_name: str = "metering"
    port: int = 8005
