"""What the gateway holds while it runs: the upstream table, the shared HTTP pool, the verifier,
the rate limiter, the OpenAPI aggregator and the metrics. Built in the lifespan, kept on
`app.state.gateway`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import httpx
from fastapi import Depends
from prometheus_client import Counter, Gauge
from starlette.requests import HTTPConnection

from gpuaas.gateway import SERVICE
from gpuaas.gateway.app_origins import AppOrigins
from gpuaas.gateway.docs import OpenAPIAggregator
from gpuaas.gateway.ratelimit import TokenBucketLimiter
from gpuaas.gateway.settings import Settings
from gpuaas.gateway.tokens import CachedVerifier
from gpuaas.gateway.upstreams import Upstream
from gpuaas.kit.metrics import ServiceMetrics


class GatewayMetrics:
    def __init__(self) -> None:
        self.service = ServiceMetrics(SERVICE)
        r = self.service.registry
        self.upstream_requests = Counter(
            "gpuaas_upstream_requests_total",
            "Requests forwarded upstream, by upstream service and its status (or unavailable/timeout/busy)",
            ["upstream", "status"],
            registry=r,
        )
        self.rate_limited = Counter("gpuaas_rate_limited_total", "Requests refused by the rate limiter", registry=r)
        self.auth_rejected = Counter(
            "gpuaas_auth_rejected_total", "Requests refused at the edge for their token", ["code"], registry=r
        )
        self.open_websockets = Gauge(
            "gpuaas_open_websockets", "WebSocket sessions currently bridged", ["upstream"], registry=r
        )


@dataclass
class GatewayRuntime:
    settings: Settings
    upstreams: dict[str, Upstream]
    client: httpx.AsyncClient
    transport: httpx.AsyncHTTPTransport  # the client's: the proxy's hot path sends through it directly
    verifier: CachedVerifier
    limiter: TokenBucketLimiter
    docs: OpenAPIAggregator
    metrics: GatewayMetrics
    app_origins: AppOrigins | None = None  # None: apps on the console's origin


def runtime(conn: HTTPConnection) -> GatewayRuntime:
    """The gateway's runtime (built by the lifespan) from a request or WebSocket."""
    rt: GatewayRuntime = conn.app.state.gateway
    return rt


# FastAPI dependency: `rt: Gateway` in a route's signature (as services write `kit: Kit`).
Gateway = Annotated[GatewayRuntime, Depends(runtime)]
