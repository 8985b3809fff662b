"""`create_app(settings)`: the gateway. No database, no broker: the lifespan owns the upstream
connection pool and the JWKS cache; nothing is built at import time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from gpuaas.gateway import apps, console, ops, proxy, websocket
from gpuaas.gateway.app_origins import AppOrigins
from gpuaas.gateway.docs import OpenAPIAggregator
from gpuaas.gateway.ratelimit import TokenBucketLimiter
from gpuaas.gateway.runtime import GatewayMetrics, GatewayRuntime
from gpuaas.gateway.settings import Settings
from gpuaas.gateway.tokens import CachedVerifier
from gpuaas.gateway.upstreams import upstream_table
from gpuaas.kit.auth import JWKSCache, TokenVerifier
from gpuaas.kit.errors import install_error_handlers
from gpuaas.kit.http import BodyLimitMiddleware, CorrelationMiddleware
from gpuaas.kit.logging import configure_logging, get_logger

log = get_logger(__name__)
VERSION = "0.1.0"


def create_app(settings: Settings | None = None, *, clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """The gateway app. `clock` (monotonic seconds) drives the rate limiter's buckets: tests pass a fake one."""
    settings = settings or Settings()
    metrics = GatewayMetrics()
    app_origins = AppOrigins.of(settings.apps_domain, settings.public_url)  # refuses a bad pair at start

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        configure_logging(settings.service_name, settings.log_level, settings.log_json)
        # httpx logs every request URL at INFO (query strings included): our `proxied` line replaces it.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        upstreams = upstream_table(settings.upstreams)
        # One keep-alive pool for everything upstream: the proxy sends through the transport directly, the
        # docs aggregator through the client around it.
        transport = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(
                max_connections=settings.upstream_max_connections,
                max_keepalive_connections=settings.upstream_max_keepalive,
                keepalive_expiry=settings.upstream_keepalive_expiry_s,
            ),
            trust_env=False,
        )
        client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(settings.upstream_timeout_s, connect=settings.upstream_connect_timeout_s),
            # Cookies belong to the browser: never keep upstream Set-Cookie in the shared client.
            cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
            follow_redirects=False,
            trust_env=False,
        )
        jwks = JWKSCache(
            settings.jwks_url, ttl_s=settings.jwks_ttl_s, min_refresh_interval_s=settings.jwks_min_refresh_s
        )
        app.state.gateway = GatewayRuntime(
            settings=settings,
            upstreams=upstreams,
            client=client,
            transport=transport,
            verifier=CachedVerifier(
                TokenVerifier(jwks, settings.jwt_issuer, settings.jwt_audience),
                max_entries=settings.token_cache_entries,
            ),
            limiter=TokenBucketLimiter(
                settings.rate_limit_per_s,
                settings.rate_limit_burst,
                prune_interval_s=settings.rate_limit_prune_interval_s,
                clock=clock,
            ),
            docs=OpenAPIAggregator(
                client,
                upstreams,
                ttl_s=settings.docs_cache_ttl_s,
                timeout_s=settings.docs_fetch_timeout_s,
                version=VERSION,
            ),
            metrics=metrics,
            app_origins=app_origins,
        )
        log.info("gateway_started", port=settings.port, upstreams=settings.upstreams)
        try:
            yield
        finally:
            await client.aclose()

    app = FastAPI(
        title="GPUaaS gateway",
        version=VERSION,
        lifespan=lifespan,
        openapi_url=None,  # /openapi.json and /docs are the aggregated ones (ops.py)
        docs_url=None,
        redoc_url=None,
    )
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(CorrelationMiddleware, metrics=metrics.service)
    if app_origins is not None:  # an app's host serves that app only (no console, API or other app)
        app.add_middleware(apps.AppHostGuard, origins=app_origins)
    app.include_router(ops.router)
    app.include_router(proxy.router)
    app.include_router(websocket.router)
    app.include_router(apps.router)  # /apps/{instance_id}/: launchable apps in the browser
    if (console_dir := console.find_console(settings.console_dir)) is not None:
        console.install(app, console_dir)
    return app


def server_config(app: FastAPI, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """How uvicorn runs the gateway (also used by the tests)."""
    options: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_config": None,  # configure_logging (lifespan) renders uvicorn's records as JSON
        "access_log": False,  # one `proxied` line per request instead, without query strings (tokens)
        "proxy_headers": False,  # X-Forwarded-* are handled by the gateway (settings.trusted_proxies)
        "server_header": False,
        "ws_max_size": settings.ws_max_message_bytes,
        "timeout_graceful_shutdown": settings.shutdown_grace_s,
        "lifespan": "on",
    }
    return uvicorn.Config(app, **(options | overrides))
