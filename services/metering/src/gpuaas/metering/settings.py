"""Settings of the metering service (env prefix `GPUAAS_METERING_`)."""

from gpuaas.kit.settings import ServiceSettings, service_config
from gpuaas.metering import SERVICE


class Settings(ServiceSettings):
    model_config = service_config(SERVICE)

    service_name: str = SERVICE
    port: int = 8005

    # Window closer: how often it looks for due meters, and how many it claims per transaction.
    closer_interval_s: float = 5.0
    closer_batch: int = 200
    # A full hour is recorded only once it is this old, so late lifecycle events still land inside it.
    window_settle_s: float = 120.0
    # Heartbeat rule: allocations on a host that stopped heartbeating are billed this long after the
    # last heartbeat, then their meters are suspended (see domain.py).
    heartbeat_grace_s: float = 600.0
    # App usage: accepted back to the start of the hourly window this long ago, and this far in the future.
    app_usage_late_s: float = 3600.0
    app_usage_skew_s: float = 300.0
