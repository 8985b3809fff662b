"""Helpers for kit integration tests: a throwaway service schema and an in-process app."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI

from gpuaas.kit.app import KitRuntime, ServiceSpec, create_app
from gpuaas.kit.migrate import upgrade
from gpuaas.kit.provision import ensure_service_schema
from gpuaas.kit.settings import ServiceSettings


async def new_service_db(admin_url: str, prefix: str) -> tuple[str, str]:
    """Provision a fresh role+schema with the kit tables; return (name, service url)."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    url = await ensure_service_schema(admin_url, name, "pw-" + name)
    await asyncio.to_thread(upgrade, url, name, None, None)
    return name, url


def settings_for(name: str, url: str, bootstrap: str, **overrides: Any) -> ServiceSettings:
    return ServiceSettings(
        service_name=name, database_url=url, kafka_bootstrap=bootstrap, jwt_issuer="http://test-issuer/api/identity",
        kafka_session_timeout_ms=6000, outbox_poll_interval_s=0.5, log_json=False, **overrides,
    )


@asynccontextmanager
async def running(app: FastAPI, *, jwks: dict[str, Any] | None = None,
                  wait_consumer: bool = True) -> AsyncIterator[tuple[httpx.AsyncClient, KitRuntime]]:
    async with app.router.lifespan_context(app):
        kit: KitRuntime = app.state.kit
        if jwks is not None:
            kit.verifier.jwks.set(jwks)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://svc") as client:
            if wait_consumer and kit.subscriptions.topics:
                await wait_for(lambda: kit.consumer is not None and kit.consumer.assigned, 60, "consumer assignment")
            else:
                await wait_for(lambda: kit.broker_ready, 60, "broker")
            yield client, kit


async def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(interval_s)


def spec(name: str, **kwargs: Any) -> ServiceSpec:
    return ServiceSpec(name=name, settings_cls=ServiceSettings, **kwargs)


def build(name: str, url: str, bootstrap: str, **kwargs: Any) -> FastAPI:
    overrides = kwargs.pop("settings", {})
    return create_app(settings_for(name, url, bootstrap, **overrides), spec(name, **kwargs))
