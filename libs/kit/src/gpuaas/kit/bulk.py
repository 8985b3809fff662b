"""Set-based writes of a batch in one statement of a fixed shape.

`insert(table).values([...])` renders a new multi-row `INSERT … VALUES (…), (…)` for every batch size:
SQLAlchemy compiles it again and Postgres (asyncpg) prepares it again each time, which for a consumer
whose batches vary in size cost about as much as the write itself. Here a batch travels as one array
per column and the statement is `INSERT INTO t (c…) SELECT … FROM unnest($1::uuid[], $2::text[], …)`:
one text, compiled and prepared once per (table, columns, options), whatever the number of rows.

JSON columns travel as text[] and are cast row by row (`::jsonb`); every other column as an array of
its own Postgres type.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from sqlalchemy import JSON, Table, TextClause, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncSession

_DIALECT = postgresql.dialect()


def _is_json(table: Table, column: str) -> bool:
    return isinstance(table.c[column].type, JSON)


def _sql_type(table: Table, column: str) -> str:
    return "text" if _is_json(table, column) else table.c[column].type.compile(dialect=_DIALECT)


@lru_cache(maxsize=256)
def _statement(
    table: Table, columns: tuple[str, ...], conflict: tuple[str, ...] | None, returning: tuple[str, ...]
) -> TextClause:
    arrays = ", ".join(f"CAST(:p{i} AS {_sql_type(table, c)}[])" for i, c in enumerate(columns))
    picked = ", ".join(f'u."{c}"::jsonb' if _is_json(table, c) else f'u."{c}"' for c in columns)
    names = ", ".join(f'"{c}"' for c in columns)
    sql = f'INSERT INTO "{table.name}" ({names}) SELECT {picked} FROM unnest({arrays}) AS u({names})'
    if conflict is not None:
        target = f" ({', '.join(conflict)})" if conflict else ""
        sql += f" ON CONFLICT{target} DO NOTHING"
    if returning:
        sql += " RETURNING " + ", ".join(f'"{c}"' for c in returning)
    return text(sql)


def _array(table: Table, column: str, rows: Sequence[Mapping[str, Any]]) -> list[Any]:
    values = [row.get(column) for row in rows]
    if _is_json(table, column):
        return [None if v is None else json.dumps(v, default=str) for v in values]
    return values


async def insert_rows(
    session: AsyncSession,
    table: Table,
    rows: Sequence[Mapping[str, Any]],
    *,
    on_conflict_do_nothing: bool | Sequence[str] = False,
    returning: Sequence[str] = (),
) -> list[Any]:
    """Insert `rows` (dicts with the same keys) in one fixed-shape statement; the RETURNING rows, if asked.

    `on_conflict_do_nothing`: True for any conflict, or the conflict target's column names.
    """
    if not rows:
        return []
    columns = tuple(rows[0].keys())
    conflict: tuple[str, ...] | None = None
    if on_conflict_do_nothing is True:
        conflict = ()
    elif on_conflict_do_nothing:
        conflict = tuple(on_conflict_do_nothing)
    stmt = _statement(table, columns, conflict, tuple(returning))
    params = {f"p{i}": _array(table, c, rows) for i, c in enumerate(columns)}
    result = await session.execute(stmt, params)
    return list(result.all()) if returning else []
