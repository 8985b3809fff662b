"""Settings of the billing service (env prefix `GPUAAS_BILLING_`)."""

from gpuaas.billing import SERVICE
from gpuaas.kit.settings import ServiceSettings, service_config


class Settings(ServiceSettings):
    model_config = service_config(SERVICE)

    service_name: str = SERVICE
    port: int = 8006
    default_budget_thresholds: list[int] = [50, 80, 100]
