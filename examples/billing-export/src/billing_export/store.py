"""The export's own schema and the effects of each event (run inside the inbox's transaction)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from gpuaas.contracts import Event
from gpuaas.contracts.events.billing import ChargePosted, StatementClosed

# A connection, or the pool's proxy of one (what `pool.acquire()` yields).
Conn = asyncpg.Connection | PoolConnectionProxy

DDL = """
CREATE SCHEMA IF NOT EXISTS {s};
-- One row per charge (the rated usage record): a charge re-published under a new event id is still one row.
CREATE TABLE IF NOT EXISTS {s}.charges (
    usage_record_id uuid PRIMARY KEY,
    charge_id uuid NOT NULL,
    event_id uuid NOT NULL,
    tenant_id uuid NOT NULL,
    project_id uuid NOT NULL,
    period_start timestamptz NOT NULL,
    currency text NOT NULL,
    sku text NOT NULL,
    app_slug text NOT NULL DEFAULT '',
    unit text NOT NULL,
    quantity numeric NOT NULL,
    amount numeric NOT NULL,
    posted_at timestamptz NOT NULL
);
-- Invoice lines: the charges summed per tenant x period x currency x project x SKU x app x unit.
CREATE TABLE IF NOT EXISTS {s}.invoice_lines (
    tenant_id uuid NOT NULL,
    period_start timestamptz NOT NULL,
    currency text NOT NULL,
    project_id uuid NOT NULL,
    sku text NOT NULL,
    app_slug text NOT NULL DEFAULT '',
    unit text NOT NULL,
    quantity numeric NOT NULL,
    amount numeric NOT NULL,
    charges integer NOT NULL,
    PRIMARY KEY (tenant_id, period_start, currency, project_id, sku, app_slug, unit)
);
-- One export per tenant x period x currency: open while charges arrive, closed by the statement.
CREATE TABLE IF NOT EXISTS {s}.exports (
    tenant_id uuid NOT NULL,
    period_start timestamptz NOT NULL,
    currency text NOT NULL,
    status text NOT NULL DEFAULT 'open' CHECK (status IN ('open', 'closed')),
    statement_id uuid,
    statement_total numeric,
    statement_lines jsonb,
    period_end timestamptz,
    closed_at timestamptz,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, period_start, currency)
);
"""


def month_start(t: datetime) -> datetime:
    t = t.astimezone(UTC)
    return t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


async def setup(conn: Conn, schema: str) -> None:
    await conn.execute(DDL.format(s=schema))


async def apply(conn: Conn, schema: str, events: list[Event]) -> None:
    """The effects of new (never seen) events, in order; other billing events are not exported."""
    for e in events:
        if isinstance(e, ChargePosted):
            await _charge(conn, schema, e)
        elif isinstance(e, StatementClosed):
            await _statement(conn, schema, e)


async def _charge(conn: Conn, s: str, e: ChargePosted) -> None:
    c = e.data
    period = c.period_start or month_start(c.usage_start)
    app = c.app_slug or ""
    inserted = await conn.fetchval(
        f"""INSERT INTO {s}.charges (usage_record_id, charge_id, event_id, tenant_id, project_id, period_start,
                currency, sku, app_slug, unit, quantity, amount, posted_at)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
            ON CONFLICT (usage_record_id) DO NOTHING RETURNING true""",
        c.usage_record_id, c.charge_id, e.id, c.tenant_id, c.project_id, period, c.currency, c.sku, app,
        c.unit.value, c.quantity, c.amount, c.posted_at,
    )  # fmt: skip
    if not inserted:
        return  # the same charge again (re-published under a new event id): counted once
    await conn.execute(
        f"""INSERT INTO {s}.invoice_lines AS l (tenant_id, period_start, currency, project_id, sku, app_slug, unit,
                quantity, amount, charges)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 1)
            ON CONFLICT (tenant_id, period_start, currency, project_id, sku, app_slug, unit) DO UPDATE
            SET quantity = l.quantity + EXCLUDED.quantity, amount = l.amount + EXCLUDED.amount,
                charges = l.charges + 1""",
        c.tenant_id, period, c.currency, c.project_id, c.sku, app, c.unit.value, c.quantity, c.amount,
    )  # fmt: skip
    await conn.execute(
        f"""INSERT INTO {s}.exports (tenant_id, period_start, currency) VALUES ($1, $2, $3)
            ON CONFLICT (tenant_id, period_start, currency) DO NOTHING""",
        c.tenant_id, period, c.currency,
    )  # fmt: skip


async def _statement(conn: Conn, s: str, e: StatementClosed) -> None:
    st = e.data
    lines = st.model_dump(mode="json")["lines"]
    await conn.execute(
        f"""INSERT INTO {s}.exports AS x (tenant_id, period_start, currency, status, statement_id, statement_total,
                statement_lines, period_end, closed_at)
            VALUES ($1, $2, $3, 'closed', $4, $5, $6::jsonb, $7, $8)
            ON CONFLICT (tenant_id, period_start, currency) DO UPDATE
            SET status = 'closed', statement_id = EXCLUDED.statement_id, statement_total = EXCLUDED.statement_total,
                statement_lines = EXCLUDED.statement_lines, period_end = EXCLUDED.period_end,
                closed_at = EXCLUDED.closed_at, updated_at = now()""",
        st.tenant_id, month_start(st.period_start), st.currency, st.statement_id, st.total_amount,
        _json(lines), st.period_end, st.closed_at,
    )  # fmt: skip


def _json(value: Any) -> str:
    return json.dumps(value)


EXPORT_SQL = """
SELECT x.tenant_id, x.period_start, x.currency, x.status, x.statement_id, x.statement_total, x.closed_at,
       (SELECT count(*) FROM {s}.charges c WHERE c.tenant_id = x.tenant_id AND c.period_start = x.period_start
           AND c.currency = x.currency AND c.posted_at > x.closed_at) AS late_charges,
       coalesce((SELECT sum(l.amount) FROM {s}.invoice_lines l WHERE l.tenant_id = x.tenant_id
                   AND l.period_start = x.period_start AND l.currency = x.currency), 0) AS total,
       coalesce((SELECT sum(l.charges) FROM {s}.invoice_lines l WHERE l.tenant_id = x.tenant_id
                   AND l.period_start = x.period_start AND l.currency = x.currency), 0) AS charges
  FROM {s}.exports x
"""


def export_row(r: asyncpg.Record) -> dict[str, Any]:
    total: Decimal = r["total"]
    statement_total: Decimal | None = r["statement_total"]
    return {
        "tenant_id": str(r["tenant_id"]),
        "period": r["period_start"].astimezone(UTC).strftime("%Y-%m"),
        "currency": r["currency"],
        "status": r["status"],
        "total": str(total),
        "charges": int(r["charges"]),
        "statement_id": str(r["statement_id"]) if r["statement_id"] else None,
        "statement_total": str(statement_total) if statement_total is not None else None,
        "reconciled": statement_total is not None and total == statement_total,
        "closed_at": r["closed_at"].isoformat() if r["closed_at"] else None,
        "late_charges": int(r["late_charges"]),
    }


async def exports(conn: Conn, s: str, tenant_id: uuid.UUID | None) -> list[dict[str, Any]]:
    where = "WHERE x.tenant_id = $1" if tenant_id else ""
    args = [tenant_id] if tenant_id else []
    sql = EXPORT_SQL.format(s=s) + f" {where} ORDER BY x.period_start DESC, x.tenant_id, x.currency"
    return [export_row(r) for r in await conn.fetch(sql, *args)]


async def lines(
    conn: Conn, s: str, tenant_id: uuid.UUID, period_start: datetime, currency: str
) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"""SELECT project_id, sku, app_slug, unit, quantity, amount, charges FROM {s}.invoice_lines
             WHERE tenant_id = $1 AND period_start = $2 AND currency = $3 ORDER BY project_id, sku, app_slug, unit""",
        tenant_id,
        period_start,
        currency,
    )
