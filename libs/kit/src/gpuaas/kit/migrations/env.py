"""Alembic environment shared by every service (see kit.migrate): async, schema-bound."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.sql.schema import SchemaItem

config = context.config
schema: str = config.attributes["schema"]
url: str = config.attributes["url"]
target_metadata = config.attributes.get("metadata")


def _include(obj: SchemaItem, name: str | None, type_: str, reflected: bool, compare_to: SchemaItem | None) -> bool:
    # Autogenerate compares only the tables of the metadata in hand: the kit's tables and the
    # alembic version table live in the same schema but belong to another branch.
    return not (type_ == "table" and reflected and compare_to is None)


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table_schema=schema,
        include_schemas=False,
        compare_type=True,
        include_object=_include,
    )
    with context.begin_transaction():
        context.run_migrations()


async def _main() -> None:
    engine = create_async_engine(url, hide_parameters=True, connect_args={"server_settings": {"search_path": schema}})
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run)
            await conn.commit()
    finally:
        await engine.dispose()


asyncio.run(_main())
