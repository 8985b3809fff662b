"""`create_app(settings, spec)`: one FastAPI app per service with everything the kit provides wired in.

The lifespan owns the runtime (engine, producer, relay, consumer, JWKS cache); nothing is built at
import time, so tests create apps with their own settings.
"""

# aiokafka ships no type information (no stubs to find); what this module exports is annotated.
# pyright: reportMissingTypeStubs=false
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Coroutine
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy import MetaData, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from starlette.requests import HTTPConnection

from gpuaas.contracts.emitters import topic_emitters
from gpuaas.kit import admin, iam, revocation, vault_keys
from gpuaas.kit.auth import JWKSCache, TokenVerifier
from gpuaas.kit.consumer import EventConsumer
from gpuaas.kit.db import create_engine, session_factory, to_plain_url
from gpuaas.kit.errors import install_error_handlers
from gpuaas.kit.event_signing import SIGNED_TOPICS, EventSigner, EventVerifier
from gpuaas.kit.http import BodyLimitMiddleware, CorrelationMiddleware
from gpuaas.kit.idempotency import IdempotencyMiddleware
from gpuaas.kit.kafka import client_security, ensure_topics, make_producer
from gpuaas.kit.logging import configure_logging, get_logger
from gpuaas.kit.metrics import BusinessMetrics, ServiceMetrics
from gpuaas.kit.relay import OutboxRelay
from gpuaas.kit.secrets_at_rest import SESSION_KEY, Keyring
from gpuaas.kit.settings import ServiceSettings
from gpuaas.kit.subscriptions import Subscriptions

log = get_logger(__name__)
Hook = Callable[["KitRuntime"], Coroutine[Any, Any, None]]
StateT = TypeVar("StateT")
SettingsT = TypeVar("SettingsT", bound=ServiceSettings)


@dataclass
class ServiceSpec:
    """What a service adds to the kit: routers, event handlers, migrations, startup hooks, loops."""

    name: str
    settings_cls: type[ServiceSettings]
    routers: list[APIRouter] = field(default_factory=list)
    subscriptions: Subscriptions | None = None
    versions_dir: Path | None = None
    metadata: MetaData | None = None
    on_startup: list[Hook] = field(default_factory=list)
    background: list[Hook] = field(default_factory=list)  # long-running loops (reconcilers)
    # The service's business metrics: built on the app's registry, gauges refreshed at every scrape.
    metrics: Callable[[CollectorRegistry], BusinessMetrics] | None = None
    with_iam: bool = True  # every service except the gateway projects identity
    # The service keeps secrets in its schema: it needs the operator's keyring (GPUAAS_SECRETS_KEYS) to start.
    secrets_at_rest: bool = False
    title: str = ""
    description: str = ""


@dataclass
class KitRuntime:
    settings: ServiceSettings
    spec: ServiceSpec
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    metrics: ServiceMetrics
    verifier: TokenVerifier
    subscriptions: Subscriptions
    # The deny list the verifier checks (revoked sessions, disabled accounts); None in the gateway (no IAM).
    revocations: revocation.DenyList | None = None
    # Secrets at rest (spec.secrets_at_rest) and envelope signatures (gpuaas.kit.event_signing).
    keyring: Keyring | None = None
    event_signer: EventSigner | None = None
    event_verifier: EventVerifier = field(default_factory=EventVerifier)
    producer: AIOKafkaProducer | None = None
    relay: OutboxRelay | None = None
    consumer: EventConsumer | None = None
    broker_ready: bool = False
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    # The service's own runtime objects (a typed dataclass set by an on_startup hook), read with state_as().
    state: object | None = None
    # Set when the service shuts down: background loops wait on it instead of sleeping.
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    def settings_as(self, cls: type[SettingsT]) -> SettingsT:
        """The service's own settings class, typed: `kit.settings_as(Settings).closer_interval_s`."""
        if not isinstance(self.settings, cls):
            raise RuntimeError(f"{self.spec.name}: settings are {type(self.settings).__name__}, not {cls.__name__}")
        return self.settings

    def state_as(self, cls: type[StateT]) -> StateT:
        """The service's runtime state, typed: `kit.state_as(AllocationsState).wakeups`."""
        if not isinstance(self.state, cls):
            raise RuntimeError(f"{self.spec.name}: runtime state is {type(self.state).__name__}, not {cls.__name__}")
        return self.state

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.append(task)
        return task


def kit_of(request: HTTPConnection) -> KitRuntime:
    """The service's runtime (built by the lifespan) from a request or WebSocket: the one way routers reach it."""
    kit: KitRuntime = request.app.state.kit
    return kit


# FastAPI dependency: `kit: Kit` in a router signature.
Kit = Annotated[KitRuntime, Depends(kit_of)]


def create_app(settings: ServiceSettings, spec: ServiceSpec) -> FastAPI:
    metrics = ServiceMetrics(spec.name)
    if spec.metrics is not None:
        metrics.business = spec.metrics(metrics.registry)
    subs = spec.subscriptions or Subscriptions()
    if spec.with_iam:
        subs = iam.subscriptions.merge(revocation.subscriptions, subs)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncGenerator[None, None]:
        configure_logging(spec.name, settings.log_level, settings.log_json)
        # Refuse to start without the keys this service needs (a clear message, before anything else runs).
        keys = await vault_keys.service_keys(settings, spec.secrets_at_rest)
        keyring = keys.keyring
        event_signer, event_verifier = event_keys(settings, spec, subs, keys.signing_seed)
        engine = create_engine(
            settings.database_url.get_secret_value(),
            settings.schema,
            pool_size=settings.db_pool_size,
            app_name=spec.name,
        )
        deny = revocation.DenyList() if spec.with_iam else None
        info = {**metrics.session_info(), **({revocation.INFO_KEY: deny} if deny else {}), SESSION_KEY: keyring}
        kit = KitRuntime(
            settings=settings,
            spec=spec,
            engine=engine,
            sessions=session_factory(engine, info=info),
            metrics=metrics,
            verifier=TokenVerifier(JWKSCache(settings.jwks_url), settings.jwt_issuer, settings.jwt_audience, deny),
            subscriptions=subs,
            revocations=deny,
            keyring=keyring,
            event_signer=event_signer,
            event_verifier=event_verifier,
        )
        app.state.kit = kit
        if deny is not None:
            await _load_revocations(kit, deny)
        for hook in spec.on_startup:
            await hook(kit)
        kit.spawn(_run_messaging(kit), "messaging")
        for loop in spec.background:
            kit.spawn(loop(kit), loop.__name__)
        if keys.vault is not None:
            follow = vault_keys.follow_signing_key(
                settings, keys.vault, keys.signing_version, event_signer, kit.stopping
            )
            kit.spawn(follow, "signing-key")
        log.info("service_started", port=settings.port)
        try:
            yield
        finally:
            await _shutdown(kit)

    app = FastAPI(
        title=spec.title or f"GPUaaS {spec.name}", description=spec.description, lifespan=lifespan, version="0.1.0"
    )
    install_error_handlers(app)
    app.add_middleware(IdempotencyMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(CorrelationMiddleware, metrics=metrics)
    _add_health(app, metrics)
    for router in [admin.router, *spec.routers]:
        iam.route_actions(router)  # before inclusion: included routers are not walked afterwards
        app.include_router(router)
    return app


async def _load_revocations(kit: KitRuntime, deny: revocation.DenyList) -> None:
    """Load the deny list before serving (a restarted replica must not accept a revoked token), then keep it
    in step with the rows other replicas' consumers write."""
    s = kit.settings
    try:
        await deny.poll(kit.sessions, s.revocation_retention_s)
    except Exception as exc:  # no database yet: the loop below retries; requests need the database anyway
        log.warning("revocations_not_loaded", error=f"{type(exc).__name__}: {exc}")
    kit.spawn(
        deny.run(
            kit.sessions,
            kit.stopping,
            interval_s=s.revocation_poll_interval_s,
            retention_s=s.revocation_retention_s,
        ),
        "revocations",
    )


async def _run_messaging(kit: KitRuntime) -> None:
    """Start producer, relay and consumer, retrying while the broker is unreachable."""
    s = kit.settings
    while True:
        try:
            await ensure_topics(
                s.kafka_bootstrap,
                prefix=s.kafka_topic_prefix,
                security=client_security(s),
                replication_factor=s.kafka_topic_replication_factor,
                min_insync_replicas=s.kafka_topic_min_insync_replicas,
            )
            producer = make_producer(s.kafka_bootstrap, s.kafka_max_message_bytes, client_security(s))
            await asyncio.wait_for(producer.start(), 30)
            kit.producer = producer
            break
        except (KafkaError, OSError, TimeoutError) as exc:
            log.warning("broker_unavailable", error=str(exc))
            await asyncio.sleep(1.0)
    kit.broker_ready = True
    if s.run_relay:
        kit.relay = OutboxRelay(
            schema=s.schema,
            engine=kit.engine,
            sessions=kit.sessions,
            producer=kit.producer,
            dsn=to_plain_url(s.database_url.get_secret_value()),
            metrics=kit.metrics,
            batch_size=s.outbox_batch_size,
            poll_interval_s=s.outbox_poll_interval_s,
            retention_hours=s.outbox_retention_hours,
            topic_prefix=s.kafka_topic_prefix,
            signer=kit.event_signer,
        )
        kit.spawn(kit.relay.run(), "outbox-relay")
    if s.run_consumers and kit.subscriptions.topics:
        kit.consumer = EventConsumer(
            name=kit.spec.name,
            group_id=s.consumer_group or kit.spec.name,
            bootstrap=s.kafka_bootstrap,
            subscriptions=kit.subscriptions,
            sessions=kit.sessions,
            metrics=kit.metrics,
            batch_size=s.consumer_batch_size,
            max_attempts=s.consumer_max_attempts,
            session_timeout_ms=s.kafka_session_timeout_ms,
            heartbeat_interval_ms=s.kafka_heartbeat_interval_ms,
            commit_timeout_s=s.consumer_commit_timeout_s,
            topic_prefix=s.kafka_topic_prefix,
            security=client_security(s),
            verifier=kit.event_verifier,
        )
        kit.spawn(kit.consumer.run(), "consumer")


def event_keys(
    settings: ServiceSettings, spec: ServiceSpec, subs: Subscriptions, seed: str | None = None
) -> tuple[EventSigner | None, EventVerifier]:
    """The service's envelope signer and the producers' public keys. Refuses (ValueError) a service that
    emits on a signed topic without a signing key, or consumes one without the public key of each service
    that may emit there (gpuaas.contracts.emitters). `seed`: the key from Vault (else the setting)."""
    seed = settings.event_signing_key.get_secret_value() if seed is None else seed
    signer = EventSigner(seed) if seed else None
    verifier = EventVerifier.parse(settings.event_verify_keys)
    for name in sorted(SIGNED_TOPICS):
        emitters = topic_emitters(name)
        if spec.name.replace("_", "-") in emitters and settings.run_relay and signer is None:
            raise ValueError(
                f"{spec.name} publishes {name}, whose events are accepted only signed: set "
                f"GPUAAS_{spec.name.upper().replace('-', '_')}_EVENT_SIGNING_KEY (base64 of an Ed25519 seed)"
            )
        untrusted = sorted(e for e in emitters if not verifier.trusts(e))
        if name in subs.topics and settings.run_consumers and untrusted:
            raise ValueError(
                f"{spec.name} consumes {name}, whose events are accepted only signed by {', '.join(sorted(emitters))}:"
                f" set GPUAAS_EVENT_VERIFY_KEYS to include `<service>:<base64 public key>` for {', '.join(untrusted)}"
            )
    return signer, verifier


async def _shutdown(kit: KitRuntime) -> None:
    kit.stopping.set()
    if kit.consumer:
        kit.consumer.stop()
    if kit.relay:
        kit.relay.stop()
    # Give the loops a moment to leave cleanly (consumer.stop() must run), then cancel the rest.
    pending: set[asyncio.Task[Any]] = set()
    if kit.tasks:
        _, pending = await asyncio.wait(kit.tasks, timeout=12)
    for task in pending:
        task.cancel()
    for task in pending:
        with suppress(asyncio.CancelledError, Exception):
            await task
    if kit.producer:
        with suppress(Exception):
            await asyncio.wait_for(kit.producer.stop(), 10)
    await kit.engine.dispose()


def _add_health(app: FastAPI, metrics: ServiceMetrics) -> None:
    @app.get("/healthz", tags=["ops"], include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"], include_in_schema=False)
    async def readyz(request: Request) -> JSONResponse:
        checks = await _readiness(request.app.state.kit)
        ready = all(checks.values())
        return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)

    @app.get("/metrics", tags=["ops"], include_in_schema=False)
    async def prometheus(request: Request) -> Response:
        kit: KitRuntime = request.app.state.kit
        # gpuaas_ready{check} is set by the /readyz probes (every few seconds); a scrape does not probe the broker
        # itself, so it never cancels a metadata request on the relay's producer mid-flight.
        try:  # dead letters, outbox lag and the service's business gauges, from its own tables
            async with kit.sessions() as session, session.begin():
                # Postgres ends a slow read itself: cancelling the await (wait_for) could leave the pooled
                # connection mid-protocol for the next user (the relay), which then failed or hung.
                await session.execute(text(f"SET LOCAL statement_timeout = {int(METRICS_REFRESH_TIMEOUT_S * 1000)}"))
                await metrics.refresh(session)
        except Exception as exc:  # metrics still answer (with the last values) while the database is away
            log.warning("metrics_refresh_failed", error=f"{type(exc).__name__}: {exc}")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


METRICS_REFRESH_TIMEOUT_S = 5.0


async def _readiness(kit: KitRuntime) -> dict[str, bool]:
    """The /readyz checks (database, broker, consumer group joined), also exported as `gpuaas_ready{check}`."""
    checks: dict[str, bool] = {}
    try:
        async with kit.sessions() as session:
            await asyncio.wait_for(session.execute(text("SELECT 1")), 3)
        checks["database"] = True
    except Exception:
        checks["database"] = False
    checks["broker"] = await _broker_ok(kit)
    if kit.settings.run_consumers and kit.subscriptions.topics:
        checks["consumer_assigned"] = bool(kit.consumer and kit.consumer.assigned)
    for name, ok in checks.items():
        kit.metrics.ready.labels(name).set(1 if ok else 0)
    return checks


async def _broker_ok(kit: KitRuntime) -> bool:
    if kit.producer is None:
        return False
    try:
        return bool(await asyncio.wait_for(kit.producer.client.fetch_all_metadata(), 3))
    except (KafkaError, TimeoutError, OSError):
        return False
