"""Settings of the app_runtime service (env prefix `GPUAAS_APP_RUNTIME_`)."""

from gpuaas.kit.settings import ServiceSettings, service_config


class Settings(ServiceSettings):
    model_config = service_config("app_runtime")

    service_name: str = "app_runtime"
    port: int = 8004
