"""Async SQLAlchemy engine and sessions bound to the service's own schema.

Tables are declared without a schema; the connection's `search_path` is the service schema,
and the service's role owns nothing else, so a query can never reach another service's tables.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import Any, cast

from sqlalchemy import CursorResult, MetaData, Result
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Session

# Stable constraint names, so Alembic migrations can refer to them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base for service models. Each service has its own metadata via subclassing."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def to_asyncpg_url(url: str) -> str:
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+asyncpg://" + url.split("://", 1)[1]
    return url


def to_plain_url(url: str) -> str:
    """libpq/asyncpg-style URL (no SQLAlchemy driver suffix)."""
    scheme, rest = url.split("://", 1)
    return "postgresql://" + rest if scheme.startswith("postgresql") or scheme == "postgres" else url


def create_engine(url: str, schema: str, *, pool_size: int = 10, app_name: str = "gpuaas") -> AsyncEngine:
    return create_async_engine(
        to_asyncpg_url(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        # Errors are logged without their bound parameters (a failed INSERT would otherwise log the secret,
        # password hash or token it carried).
        hide_parameters=True,
        connect_args={"server_settings": {"search_path": schema, "application_name": app_name}},
    )


class ServiceSession(Session):
    """The sync session under every AsyncSession of the kit: the class kit hooks attach events to."""


def session_factory(engine: AsyncEngine, *, info: dict[str, Any] | None = None) -> async_sessionmaker[AsyncSession]:
    """Sessions of the service's schema; `info` is copied into every session's `info` (the app's metrics)."""
    return async_sessionmaker(
        engine, expire_on_commit=False, autoflush=False, sync_session_class=ServiceSession, info=info
    )


@asynccontextmanager
async def unit_of_work(factory: async_sessionmaker[AsyncSession]) -> AsyncGenerator[AsyncSession, None]:
    """One transaction: state change + outbox rows commit together, or nothing does."""
    async with factory() as session, session.begin():
        yield session


def rows_affected(result: Result[Any]) -> int:
    """How many rows an UPDATE or DELETE touched: `session.execute` is typed as returning a plain Result, but
    for a DML statement it is a CursorResult, which counts them."""
    return cast(CursorResult[Any], result).rowcount
