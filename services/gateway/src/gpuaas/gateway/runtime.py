"""What the gateway holds while it runs: the upstream table, the shared HTTP pool, the verifier,
the rate limiter, the OpenAPI aggregator and the metrics. Built in the lifespan, kept on
`app.state.gateway`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from prometheus_client import Counter, Gauge
from starlette.requests import HTTPConnection

from gpuaas.kit.auth import TokenVerifier
from gpuaas.kit.metrics import ServiceMetrics

if TYPE_CHECKING:
    from gpuaas.gateway.docs import OpenAPIAggregator
    from gpuaas.gateway.ratelimit import TokenBucketLimiter
    from gpuaas.gateway.settings import Settings


@dataclass(frozen=True)
class Upstream:
    name: str  # settings key, e.g. "app_runtime"
    base_url: str  # no trailing slash

    @property
    def segment(self) -> str:
        """The public path segment: /api/<segment>/..."""
        return self.name.replace("_", "-")

    @property
    def ws_base_url(self) -> str:
        return "ws" + self.base_url.removeprefix("http")


def upstream_table(upstreams: dict[str, str]) -> dict[str, Upstream]:
    """Upstreams keyed by public path segment."""
    table = [Upstream(name, url) for name, url in upstreams.items()]
    return {u.segment: u for u in table}


class GatewayMetrics:
    def __init__(self) -> None:
        self.service = ServiceMetrics("gateway")
        r = self.service.registry
        self.upstream_requests = Counter(
            "gpuaas_gateway_upstream_requests_total",
            "Requests forwarded upstream, by service and upstream status (or unavailable/timeout/busy)",
            ["service", "status"],
            registry=r,
        )
        self.rate_limited = Counter(
            "gpuaas_gateway_rate_limited_total", "Requests refused by the rate limiter", registry=r
        )
        self.auth_rejected = Counter(
            "gpuaas_gateway_auth_rejected_total", "Requests refused at the edge for their token", ["code"], registry=r
        )
        self.open_websockets = Gauge(
            "gpuaas_gateway_open_websockets", "WebSocket sessions currently bridged", ["service"], registry=r
        )


@dataclass
class GatewayRuntime:
    settings: Settings
    upstreams: dict[str, Upstream]
    client: httpx.AsyncClient
    verifier: TokenVerifier
    limiter: TokenBucketLimiter
    docs: OpenAPIAggregator
    metrics: GatewayMetrics


def runtime(conn: HTTPConnection) -> GatewayRuntime:
    return conn.app.state.gateway  # type: ignore[no-any-return]
