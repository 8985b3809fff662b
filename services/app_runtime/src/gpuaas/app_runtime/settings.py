"""Settings of the app_runtime service (env prefix `GPUAAS_APP_RUNTIME_`)."""

from typing import Literal

from pydantic import SecretStr

from gpuaas.kit.settings import ServiceSettings, service_config


class Settings(ServiceSettings):
    model_config = service_config("app_runtime")

    service_name: str = "app_runtime"
    port: int = 8004

    # Member operation leases.
    lease_default_s: int = 30
    lease_max_s: int = 600
    # A deferred operation is offered again after the delay its controller asked for, at most this long
    # (sooner when its instance changes).
    defer_max_s: int = 300
    reconcile_interval_s: float = 2.0
    # A release request whose members are not cleared by then is cleared as forced.
    release_clearance_timeout_s: int = 600

    # Access credential custody: "schema" (AES-256-GCM envelope encryption in this service's schema)
    # or "vault" (Vault/OpenBao KV v2: the private key itself in Vault) or "transit" (envelope encryption in
    # this schema, each credential's data key wrapped by the Transit key `vault_transit_key`; rows sealed
    # before under the keyring still open, and `python -m gpuaas.app_runtime.rewrap` moves them to Transit).
    # The server and its authentication: the kit's `vault_*` settings (gpuaas.kit.vault).
    credential_backend: Literal["schema", "vault", "transit"] = "schema"
    # Empty: the service's keyring (GPUAAS_SECRETS_KEYS) wraps the data keys. There is no default key.
    credential_kek: SecretStr = SecretStr("")
    credential_kek_id: str = "kek-1"
    vault_mount: str = "secret"
    vault_path_prefix: str = "gpuaas/app-runtime/credentials"

    # SSE: how often the stream looks for new timeline entries.
    sse_poll_interval_s: float = 0.5
