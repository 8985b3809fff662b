"""Service settings (pydantic-settings).

Service-specific values use the prefix `GPUAAS_<SERVICE>_` (e.g. `GPUAAS_IDENTITY_DATABASE_URL`);
infrastructure shared by every service (broker, JWKS) is read from `GPUAAS_*` without the service
part, so one variable points the whole suite at a real Kafka.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator
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

    kafka_bootstrap: str = Field(default="127.0.0.1:9092", validation_alias=_shared("kafka_bootstrap"))
    kafka_session_timeout_ms: int = Field(default=6000, validation_alias=_shared("kafka_session_timeout_ms"))
    kafka_heartbeat_interval_ms: int = Field(default=1000, validation_alias=_shared("kafka_heartbeat_interval_ms"))
    # Namespace on a shared cluster: prefixed to every topic and consumer group on the wire (the outbox and
    # the contracts keep the logical names), so two deployments never read each other's events.
    kafka_topic_prefix: str = Field(
        default="", pattern=r"^[A-Za-z0-9._-]{0,100}$", validation_alias=_shared("kafka_topic_prefix")
    )
    # Enforced on the producer side: Tansu does not enforce a maximum message size.
    kafka_max_message_bytes: int = 1_000_000
    # How every Kafka client of the service (producer, consumers, topic admin) connects: PLAINTEXT, SSL (TLS),
    # SASL_PLAINTEXT or SASL_SSL (SASL over TLS).
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", validation_alias=_shared("kafka_security_protocol")
    )
    # SASL mechanism with a SASL_* protocol: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512.
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        default="PLAIN", validation_alias=_shared("kafka_sasl_mechanism")
    )
    # SASL user name (required with a SASL_* protocol).
    kafka_sasl_username: str = Field(default="", validation_alias=_shared("kafka_sasl_username"))
    # SASL password (required with a SASL_* protocol).
    kafka_sasl_password: SecretStr = Field(default=SecretStr(""), validation_alias=_shared("kafka_sasl_password"))
    # CA bundle (PEM file) the broker's certificate is verified against with SSL/SASL_SSL; empty: the system CAs.
    kafka_ssl_cafile: str = Field(default="", validation_alias=_shared("kafka_ssl_cafile"))
    # Client certificate (PEM file) for mutual TLS; empty: none.
    kafka_ssl_certfile: str = Field(default="", validation_alias=_shared("kafka_ssl_certfile"))
    # Private key (PEM file) of the client certificate.
    kafka_ssl_keyfile: str = Field(default="", validation_alias=_shared("kafka_ssl_keyfile"))
    # Replication factor of the topics the services create when missing (3 on a production cluster).
    kafka_topic_replication_factor: int = Field(
        default=1, ge=1, validation_alias=_shared("kafka_topic_replication_factor")
    )
    # `min.insync.replicas` of the topics the services create (2 with replication factor 3); 0: the broker's default.
    kafka_topic_min_insync_replicas: int = Field(
        default=0, ge=0, validation_alias=_shared("kafka_topic_min_insync_replicas")
    )

    jwks_url: str = Field(default="http://127.0.0.1:8001/.well-known/jwks.json", validation_alias=_shared("jwks_url"))
    jwt_issuer: str = Field(default="http://127.0.0.1:8000/api/identity", validation_alias=_shared("jwt_issuer"))
    jwt_audience: str = Field(default="gpuaas", validation_alias=_shared("jwt_audience"))
    # Revocation (gpuaas.kit.revocation): how often each replica reads the deny-list rows other replicas wrote.
    revocation_poll_interval_s: float = Field(default=0.5, gt=0, validation_alias=_shared("revocation_poll_interval_s"))
    # How long a deny-list row is kept: must exceed the longest access-token lifetime (identity's default 900 s).
    revocation_retention_s: float = Field(default=86400.0, gt=0, validation_alias=_shared("revocation_retention_s"))

    # Secrets at rest (gpuaas.kit.secrets_at_rest): `kid:base64(32 bytes)[,...]`, the first key seals. No
    # default: a service that stores secrets refuses to start without it (the local stack generates one).
    secrets_keys: SecretStr = Field(default=SecretStr(""), validation_alias=_shared("secrets_keys"))
    # This service's Ed25519 key for the envelopes its relay publishes (base64 seed; gpuaas.kit.event_signing).
    event_signing_key: SecretStr = SecretStr("")
    # Where the keyring and the event-signing key come from (gpuaas.kit.vault_keys): `env` (the two settings
    # above) or `vault` (the keyring's data keys wrapped by this service's Transit key, kept in KV at
    # `<kv mount>/<service>/secrets-keys`; the signing key in KV at `<service>/event-signing`, followed on rotation).
    secrets_key_source: Literal["env", "vault"] = Field(default="env", validation_alias=_shared("secrets_key_source"))
    # The Vault / OpenBao server (gpuaas.kit.vault), per service (`GPUAAS_<SERVICE>_VAULT_*`).
    vault_url: str = "http://127.0.0.1:8200"
    # `approle` (role_id + secret_id; the token is renewed and replaced) or `token` (a static token, renewed
    # while renewable); empty: `approle` when a role_id is set, else `token`.
    vault_auth: Literal["approle", "token", ""] = ""
    vault_role_id: str = ""
    vault_secret_id: SecretStr = SecretStr("")
    vault_token: SecretStr = SecretStr("")
    vault_approle_mount: str = "approle"
    # PEM bundle the server's certificate is verified against; empty: the system CAs.
    vault_ca_cert: str = ""
    vault_kv_mount: str = "gpuaas-kv"
    vault_transit_mount: str = "gpuaas-transit"
    # The Transit key that wraps this service's data keys; empty: the service's name (`app-runtime`).
    vault_transit_key: str = ""
    # How often the signing key's KV version is checked (a rotation is picked up without a restart).
    vault_refresh_interval_s: float = Field(default=60.0, gt=0)
    # Public keys of the producing services whose signed topics this service consumes:
    # `service:base64(public key)[,...]` (several per service while one rotates).
    event_verify_keys: str = Field(default="", validation_alias=_shared("event_verify_keys"))

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

    # The database schema; shadows pydantic v1's deprecated `schema()` classmethod, which nothing here calls.
    @property
    def schema(self) -> str:  # pyright: ignore[reportIncompatibleMethodOverride]
        return self.db_schema or self.service_name

    @model_validator(mode="after")
    def _kafka_security_complete(self) -> ServiceSettings:
        if self.kafka_security_protocol.startswith("SASL_") and not (
            self.kafka_sasl_username and self.kafka_sasl_password.get_secret_value()
        ):
            raise ValueError(
                f"kafka_security_protocol={self.kafka_security_protocol} needs a SASL username and password"
            )
        if bool(self.kafka_ssl_certfile) != bool(self.kafka_ssl_keyfile):
            raise ValueError("kafka_ssl_certfile and kafka_ssl_keyfile go together (mutual TLS)")
        if self.kafka_topic_min_insync_replicas > self.kafka_topic_replication_factor:
            raise ValueError("kafka_topic_min_insync_replicas cannot exceed kafka_topic_replication_factor")
        return self


def service_config(service: str) -> SettingsConfigDict:
    """The settings config for one service: env prefix `GPUAAS_<SERVICE>_`."""
    return SettingsConfigDict(env_prefix=f"GPUAAS_{service.upper()}_", populate_by_name=True, extra="ignore")
