"""kit.bulk.insert_rows on the real Postgres: every column type the services use round-trips, ON CONFLICT
DO NOTHING returns only the rows it inserted, and batches of any size share one statement text."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import BigInteger, Column, DateTime, MetaData, Numeric, Table, Text, text
from sqlalchemy.dialects.postgresql import JSONB, UUID

from gpuaas.kit import bulk
from gpuaas.kit.db import create_engine, session_factory
from gpuaas.kit.testing import new_service_db

pytestmark = pytest.mark.integration

metadata = MetaData()
things = Table(
    "bulk_things",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("n", BigInteger, nullable=False),
    Column("amount", Numeric(24, 9)),
    Column("at", DateTime(timezone=True)),
    Column("doc", JSONB),
    Column("note", Text),
)


async def test_insert_rows_round_trips_types_dedupes_and_keeps_one_statement(infra: Any) -> None:
    name, url = await new_service_db(infra.admin_url, "bulk")
    engine = create_engine(url, name)
    sessions = session_factory(engine)
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    at = datetime(2026, 11, 24, 6, 0, tzinfo=UTC)
    rows = [
        {"id": uuid.uuid4(), "n": i, "amount": Decimal("1.000000001") * i, "at": at, "doc": {"i": i, "k": [1, "x"]}}
        for i in range(3)
    ]
    rows.append({"id": uuid.uuid4(), "n": 9, "amount": None, "at": None, "doc": None})
    bulk._statement.cache_clear()
    try:
        async with sessions() as s, s.begin():
            got = await bulk.insert_rows(s, things, rows, on_conflict_do_nothing=True, returning=("id",))
            assert {r.id for r in got} == {r["id"] for r in rows}
            # Again with one fresh row among the known ones: only the fresh one is returned.
            fresh = {"id": uuid.uuid4(), "n": 10, "amount": Decimal(0), "at": at, "doc": {"new": True}}
            got = await bulk.insert_rows(s, things, [*rows[:2], fresh], on_conflict_do_nothing=True, returning=("id",))
            assert [r.id for r in got] == [fresh["id"]]
            stored = (await s.execute(text("SELECT n, amount, at, doc, note FROM bulk_things ORDER BY n"))).all()
        assert [tuple(r) for r in stored] == [
            (0, Decimal("0E-9"), at, {"i": 0, "k": [1, "x"]}, None),
            (1, Decimal("1.000000001"), at, {"i": 1, "k": [1, "x"]}, None),
            (2, Decimal("2.000000002"), at, {"i": 2, "k": [1, "x"]}, None),
            (9, None, None, None, None),
            (10, Decimal("0E-9"), at, {"new": True}, None),
        ]
        # Batches of 4 and 3 rows, same columns and options: one compiled statement.
        assert bulk._statement.cache_info().currsize == 1
        async with sessions() as s, s.begin():
            assert await bulk.insert_rows(s, things, []) == []
    finally:
        await engine.dispose()
