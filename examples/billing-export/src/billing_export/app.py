"""The consumer (FastStream broker + the inbox) and the read-only HTTP API, in one process."""

from __future__ import annotations

import csv
import io
import logging
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg
from fastapi import FastAPI, HTTPException, Query, Response
from faststream.kafka import KafkaBroker

from billing_export import store
from gpuaas.contracts import Event
from gpuaas.contracts.faststream import PgInbox, asyncapi, event_subscriber
from gpuaas.contracts.registry import BILLING

GROUP = "billing-export"


@dataclass
class Settings:
    """From the environment: BILLING_EXPORT_DATABASE_URL (its own database or schema owner),
    BILLING_EXPORT_KAFKA_BOOTSTRAP (else GPUAAS_KAFKA_BOOTSTRAP), GPUAAS_KAFKA_TOPIC_PREFIX,
    BILLING_EXPORT_SCHEMA (default billing_export), BILLING_EXPORT_GROUP, BILLING_EXPORT_MAX_RECORDS."""

    database_url: str
    bootstrap: str
    prefix: str = ""
    schema: str = "billing_export"
    group: str = GROUP
    max_records: int = 500
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ
        return cls(
            database_url=env["BILLING_EXPORT_DATABASE_URL"],
            bootstrap=env.get("BILLING_EXPORT_KAFKA_BOOTSTRAP") or env.get("GPUAAS_KAFKA_BOOTSTRAP", "127.0.0.1:9092"),
            prefix=env.get("GPUAAS_KAFKA_TOPIC_PREFIX", ""),
            schema=env.get("BILLING_EXPORT_SCHEMA", "billing_export"),
            group=env.get("BILLING_EXPORT_GROUP", GROUP),
            max_records=int(env.get("BILLING_EXPORT_MAX_RECORDS", "500")),
        )


class Consumer:
    """The broker with its one subscriber; `start()` needs the pool (created in the lifespan)."""

    def __init__(self, settings: Settings, broker: KafkaBroker | None = None) -> None:
        self.settings = settings
        # FastStream's per-batch "Received/Processed" lines at DEBUG; errors are still logged.
        self.broker = broker or KafkaBroker(settings.bootstrap, graceful_timeout=10.0, log_level=logging.DEBUG)
        self.pool: asyncpg.Pool | None = None
        self.inbox = PgInbox(self._pool, schema=settings.schema, consumer=settings.group)
        schema = settings.schema

        @event_subscriber(
            self.broker,
            BILLING,
            group=settings.group,
            prefix=settings.prefix,
            inbox=self.inbox,
            max_records=settings.max_records,
            title="billing-export",
            description="Charges into invoice lines; statements close exports.",
        )
        async def on_billing(conn: asyncpg.Connection, events: list[Event]) -> None:
            """charge.posted → invoice lines; statement.closed → the export is closed."""
            await store.apply(conn, schema, events)

    def _pool(self) -> asyncpg.Pool:
        assert self.pool is not None, "Consumer.open() first"
        return self.pool

    async def open(self) -> None:
        self.pool = await asyncpg.create_pool(self.settings.database_url, min_size=1, max_size=4)
        async with self.pool.acquire() as conn:
            await store.setup(conn, self.settings.schema)
            await self.inbox.setup(conn)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()

    def asyncapi(self) -> dict[str, Any]:
        return asyncapi(self.broker, title="billing-export", description=store.__doc__ or "")


def create_app(settings: Settings | None = None, *, consume: bool = True) -> FastAPI:
    settings = settings or Settings.from_env()
    consumer = Consumer(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await consumer.open()
        if consume:
            await consumer.broker.start()
        try:
            yield
        finally:
            if consume:
                await consumer.broker.stop()  # bounded: waits for the batch in hand up to graceful_timeout
            await consumer.close()

    app = FastAPI(title="billing-export", lifespan=lifespan)
    app.state.consumer = consumer
    s = settings.schema

    def pool() -> asyncpg.Pool:
        assert consumer.pool is not None
        return consumer.pool

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        async with pool().acquire() as conn:
            await conn.fetchval("SELECT 1")
        return {"ok": True}

    @app.get("/exports")
    async def list_exports(tenant_id: uuid.UUID | None = Query(default=None)) -> list[dict[str, Any]]:
        async with pool().acquire() as conn:
            return await store.exports(conn, s, tenant_id)

    @app.get("/exports/{tenant_id}/{period}/{currency}.csv")
    async def export_csv(tenant_id: uuid.UUID, period: str, currency: str) -> Response:
        try:
            start = datetime.strptime(period, "%Y-%m").replace(tzinfo=UTC)
        except ValueError:
            raise HTTPException(422, "period: YYYY-MM") from None
        async with pool().acquire() as conn:
            rows = await store.lines(conn, s, tenant_id, start, currency.upper())
        if not rows:
            raise HTTPException(404, "no invoice lines for this tenant, period and currency")
        out = io.StringIO()
        w = csv.writer(out)
        w.writerow(["tenant_id", "period", "currency", "project_id", "sku", "app_slug", "unit", "quantity", "amount"])
        for r in rows:
            w.writerow([tenant_id, period, currency.upper(), r["project_id"], r["sku"], r["app_slug"], r["unit"],
                        r["quantity"], r["amount"]])  # fmt: skip
        return Response(out.getvalue(), media_type="text/csv")

    @app.get("/asyncapi.json")
    async def asyncapi_doc() -> dict[str, Any]:
        return consumer.asyncapi()

    return app
