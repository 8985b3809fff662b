"""Service settings (pydantic-settings).

Service-specific values use the prefix `GPUAAS_<SERVICE>_` (e.g. `GPUAAS_IDENTITY_DATABASE_URL`);
infrastructure shared by every service (broker, JWKS) is read from `GPUAAS_*` without the service
part, so one variable points the whole suite at a real Kafka.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


def _shared(name: str) -> AliasChoices:
    return AliasChoices(name, f"GPUAAS_{name.upper()}")


class ServiceSettings(BaseSettings):
    """Base of every service's settings. Subclasses set `model_config = service_config("identity")`."""

    model_config = SettingsConfigDict(env_prefix="GPUAAS_SERVICE_", populate_by_name=True, extra="ignore")

    service_name: str = "service"
    host: str = "127.0.0.1"
    port: int = 8080
    # The service's own role; it can touch only its own schema (see kit.db.provision).
    database_url: SecretStr = SecretStr("postgresql+asyncpg://postgres@127.0.0.1:5433/gpuaas")
    db_schema: str = ""
    db_pool_size: int = 10

    kafka_bootstrap: str = Field("127.0.0.1:9092", validation_alias=_shared("kafka_bootstrap"))
    kafka_session_timeout_ms: int = Field(6000, validation_alias=_shared("kafka_session_timeout_ms"))
    kafka_heartbeat_interval_ms: int = Field(1000, validation_alias=_shared("kafka_heartbeat_interval_ms"))
    # Namespace on a shared cluster: prefixed to every topic and consumer group on the wire (the outbox and
    # the contracts keep the logical names), so two deployments never read each other's events.
    kafka_topic_prefix: str = Field(
        "", pattern=r"^[A-Za-z0-9._-]{0,100}$", validation_alias=_shared("kafka_topic_prefix")
    )
    # Enforced on the producer side: Tansu does not enforce a maximum message size.
    kafka_max_message_bytes: int = 1_000_000

    jwks_url: str = Field("http://127.0.0.1:8001/.well-known/jwks.json", validation_alias=_shared("jwks_url"))
    jwt_issuer: str = Field("http://127.0.0.1:8000/api/identity", validation_alias=_shared("jwt_issuer"))
    jwt_audience: str = Field("gpuaas", validation_alias=_shared("jwt_audience"))

    outbox_batch_size: int = 500
    outbox_poll_interval_s: float = 1.0
    outbox_retention_hours: int = 24 * 7
    consumer_batch_size: int = 500
    consumer_max_attempts: int = 3
    consumer_commit_timeout_s: float = 10.0
    # Defaults to the service name: one consumer group per service (Tansu joins are slow per group).
    consumer_group: str = ""
    run_consumers: bool = True
    run_relay: bool = True

    max_request_bytes: int = 1_000_000
    log_level: str = "INFO"
    log_json: bool = True

    @property
    def schema(self) -> str:
        return self.db_schema or self.service_name


def service_config(service: str) -> SettingsConfigDict:
    """The settings config for one service: env prefix `GPUAAS_<SERVICE>_`."""
    return SettingsConfigDict(env_prefix=f"GPUAAS_{service.upper()}_", populate_by_name=True, extra="ignore")
