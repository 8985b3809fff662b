"""Settings of the identity service (env prefix `GPUAAS_IDENTITY_`)."""

from pydantic import SecretStr

from gpuaas.kit.settings import ServiceSettings, service_config


class Settings(ServiceSettings):
    model_config = service_config("identity")

    service_name: str = "identity"
    port: int = 8001
    # The issuer URL clients see (through the gateway); tokens carry it as `iss`.
    public_url: str = "http://127.0.0.1:8000/api/identity"
    access_token_ttl_s: int = 900
    # First platform operator, created at first start when no user has this email.
    bootstrap_admin_email: str | None = None
    bootstrap_admin_password: SecretStr | None = None
