"""Settings of the gateway (env prefix `GPUAAS_GATEWAY_`; JWKS/issuer/audience are the shared `GPUAAS_*`).

The gateway has no database and no broker: the inherited database/Kafka fields are unused.
"""

from __future__ import annotations

from pydantic import SecretStr, field_validator

from gpuaas.gateway import SERVICE
from gpuaas.kit.settings import ServiceSettings, service_config

DEFAULT_UPSTREAMS = {
    "identity": "http://127.0.0.1:8001",
    "allocations": "http://127.0.0.1:8002",
    "catalog": "http://127.0.0.1:8003",
    "app_runtime": "http://127.0.0.1:8004",
    "metering": "http://127.0.0.1:8005",
    "billing": "http://127.0.0.1:8006",
}


class Settings(ServiceSettings):
    model_config = service_config(SERVICE)

    service_name: str = SERVICE
    port: int = 8000

    # Service name -> base URL. `GPUAAS_GATEWAY_UPSTREAMS` is JSON and replaces the whole map.
    # The public path segment is the name with `_` turned into `-` (app_runtime -> /api/app-runtime/).
    upstreams: dict[str, str] = dict(DEFAULT_UPSTREAMS)
    upstream_connect_timeout_s: float = 5.0
    # Longest wait for the upstream's response headers, and between two body chunks (-> 504).
    upstream_timeout_s: float = 30.0
    # Same, for event streams (SSE) where silence between events is normal.
    stream_idle_timeout_s: float = 300.0
    upstream_max_connections: int = 1000
    upstream_max_keepalive: int = 100
    # An idle upstream connection is kept this long for reuse (services keep theirs 5 s: uvicorn's default).
    upstream_keepalive_expiry_s: float = 4.0

    # Token bucket per principal (token `sub`, else client IP); rate <= 0 turns limiting off.
    rate_limit_per_s: float = 50.0
    rate_limit_burst: int = 100
    rate_limit_prune_interval_s: float = 60.0

    # Proxies whose X-Forwarded-For/-Proto/-Host are believed (a load balancer in front): addresses or CIDR
    # networks. Empty: none (a client's own X-Forwarded-For is then dropped, never passed on).
    trusted_proxies: list[str] = []

    # /metrics: with a token, only `Authorization: Bearer <token>`; without one, only a direct (not proxied:
    # no X-Forwarded-For) caller from metrics_networks (the cluster's scraper). docs/decisions.md.
    metrics_token: SecretStr | None = None
    # Networks a direct /metrics caller may come from when no metrics_token is set (default: loopback, private).
    metrics_networks: list[str] = [
        "127.0.0.0/8",
        "::1/128",
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "fc00::/7",
    ]

    # Verified tokens remembered (LRU) until they expire or the JWKS is refreshed (tokens.py); 0: no cache.
    token_cache_entries: int = 10_000
    jwks_ttl_s: float = 300.0
    # A token with an unknown `kid` refetches the JWKS at most this often (key rotation).
    jwks_min_refresh_s: float = 5.0

    docs_cache_ttl_s: float = 30.0
    docs_fetch_timeout_s: float = 3.0
    readiness_timeout_s: float = 2.0

    # The built web console (index.html + assets/) served at `/`. None: web/console/dist of the checkout
    # if built; "": no console (placeholder page).
    console_dir: str | None = None

    # An origin per launchable app (app_origins.py): each app at `<instance id>.<apps_domain>`, with the scheme
    # and port of `public_url` (the console's URL, e.g. https://gpu.example.com). Needs wildcard DNS (and a
    # wildcard certificate) for the apps domain; `*.localhost` resolves to loopback in browsers. None: apps
    # are served on the console's own origin (docs/decisions.md says what that exposes).
    apps_domain: str | None = None
    # The console's URL as browsers reach it (scheme://host[:port]); required with apps_domain: app origins take
    # its scheme and port, and an app's expired session is sent back to its sign-in there.
    public_url: str | None = None

    ws_max_message_bytes: int = 16 * 1024 * 1024
    ws_open_timeout_s: float = 10.0
    # On shutdown, open streams (SSE, WebSocket) get this long before they are cut.
    shutdown_grace_s: int = 10

    @field_validator("upstreams")
    @classmethod
    def _check_upstreams(cls, value: dict[str, str]) -> dict[str, str]:
        for name, url in value.items():
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"upstream {name!r} must be an http(s) URL, got {url!r}")
        return {name: url.rstrip("/") for name, url in value.items()}
