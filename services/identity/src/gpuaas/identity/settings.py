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
    # Refresh tokens rotate on every use; a session (refresh-token family) ends at the latest after this.
    refresh_token_ttl_s: int = 14 * 24 * 3600
    session_max_age_s: int = 30 * 24 * 3600
    id_token_ttl_s: int = 300
    authorization_code_ttl_s: int = 60
    sso_state_ttl_s: int = 600
    # The single-use code a completed SSO login hands to `return_to` lives this long.
    sso_login_code_ttl_s: int = 60
    # Origins besides public_url's that may receive an SSO result (a console served elsewhere).
    # The CLI's loopback listener (http://127.0.0.1:<port>/...) is always allowed.
    sso_return_origins: list[str] = []
    # Brute-force protection: per account (email) and per source address, over a sliding window.
    lockout_threshold: int = 5
    lockout_window_s: int = 900
    lockout_s: int = 300
    source_threshold: int = 50
    # Peers whose X-Forwarded-For is believed (the gateway). Its last hop is the caller's address.
    trusted_proxies: list[str] = ["127.0.0.1", "::1"]
    # Timeout of calls to enterprise identity providers (discovery, token exchange, JWKS).
    idp_timeout_s: float = 10.0
    # First platform operator, created at first start when no user has this email.
    bootstrap_admin_email: str | None = None
    bootstrap_admin_password: SecretStr | None = None
