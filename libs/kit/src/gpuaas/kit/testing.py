"""Test support for any service: a throwaway service schema with the kit tables, and an in-process app
with its lifespan running (real Postgres, real broker). Used by the kit's and the services' tests."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI

from gpuaas.contracts.emitters import SERVICES
from gpuaas.kit.app import KitRuntime, ServiceSpec, create_app
from gpuaas.kit.event_signing import EventSigner, generate_seed, public_of
from gpuaas.kit.migrate import upgrade
from gpuaas.kit.provision import ensure_service_schema
from gpuaas.kit.secrets_at_rest import generate_key_text
from gpuaas.kit.settings import ServiceSettings

# Keys of this test process (random per run, never a published default): the secrets keyring, and an
# envelope signing key per producing service, whose public halves every test app trusts.
TEST_SECRETS_KEYS = generate_key_text("test")
_TEST_SEEDS: dict[str, str] = {}


def event_seed_of(service: str) -> str:
    # One key per emitter name: app-runtime's spec is `app_runtime`, its events' source `app-runtime`.
    return _TEST_SEEDS.setdefault(service.replace("_", "-"), generate_seed())


def event_signer_of(service: str) -> EventSigner:
    """The signer test helpers use to put `service`'s events on the broker (gpuaas.kit.testing_events)."""
    return EventSigner(event_seed_of(service))


def trusted_event_keys() -> str:
    return ",".join(f"{s}:{public_of(event_seed_of(s))}" for s in SERVICES)


def key_settings(service: str) -> dict[str, str]:
    """The key settings a test app of `service` starts with."""
    return {
        "secrets_keys": TEST_SECRETS_KEYS,
        "event_signing_key": event_seed_of(service),
        "event_verify_keys": trusted_event_keys(),
    }


async def new_service_db(admin_url: str, prefix: str, spec: ServiceSpec | None = None) -> tuple[str, str]:
    """Provision a fresh role+schema migrated with the kit tables (and the spec's own migrations);
    return (schema name, service url)."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    url = await ensure_service_schema(admin_url, name, "pw-" + name)
    versions, metadata = (spec.versions_dir, spec.metadata) if spec else (None, None)
    await asyncio.to_thread(upgrade, url, name, versions, metadata)
    return name, url


async def service_app(spec: ServiceSpec, admin_url: str, bootstrap: str, **overrides: Any) -> FastAPI:
    """A real service app (its own routers, handlers, migrations) on a fresh schema of the test database.

    Each app gets its own consumer group, so apps of the same service in one test session never share
    partitions; it reads the identity topic from the start like a new deployment would.
    """
    schema, url = await new_service_db(admin_url, spec.name, spec)
    # Raw values, validated (and coerced: a URL into SecretStr) by the settings model.
    values: dict[str, Any] = {
        "database_url": url,
        "db_schema": schema,
        "kafka_bootstrap": bootstrap,
        "consumer_group": schema,
        "jwt_issuer": "http://test-issuer/api/identity",
        "kafka_session_timeout_ms": 6000,
        "outbox_poll_interval_s": 0.5,
        "log_json": False,
        **key_settings(spec.name),
        **overrides,
    }
    return create_app(spec.settings_cls(**values), spec)


def settings_for(name: str, url: str, bootstrap: str, **overrides: Any) -> ServiceSettings:
    values: dict[str, Any] = {
        "service_name": name,
        "database_url": url,
        "kafka_bootstrap": bootstrap,
        "jwt_issuer": "http://test-issuer/api/identity",
        "kafka_session_timeout_ms": 6000,
        "outbox_poll_interval_s": 0.5,
        "log_json": False,
        **key_settings(name),
        **overrides,
    }
    return ServiceSettings(**values)


@asynccontextmanager
async def running(
    app: FastAPI, *, jwks: dict[str, Any] | None = None, wait_consumer: bool = True
) -> AsyncGenerator[tuple[httpx.AsyncClient, KitRuntime], None]:
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
