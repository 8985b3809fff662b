"""Create the database, one role per service and its schema (run as a superuser by the runner).

The role owns its schema and nothing else; `public` is closed to everyone, so the role cannot
create or read objects outside its schema. Idempotent: safe on every `make run`.
"""

# aiokafka and asyncpg ship no type information, so what this module gets back from them is unknown to the
# checker: it does not report those unknowns here (what the module itself exports is annotated).
# pyright: reportMissingTypeStubs=false, reportUnknownMemberType=false
# pyright: reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from gpuaas.kit.db import to_plain_url

_IDENT = re.compile(r"^[a-z_][a-z0-9_]*$")


def _ident(name: str) -> str:
    if not _IDENT.match(name):
        raise ValueError(f"unsafe SQL identifier {name!r}")
    return name


def role_name(service: str) -> str:
    return f"gpuaas_{_ident(service)}"


def service_url(admin_url: str, service: str, password: str, database: str | None = None) -> str:
    """The service's own connection URL: same host/port/db as the admin URL, its own role."""
    parts = urlsplit(to_plain_url(admin_url))
    host = parts.hostname or "127.0.0.1"
    netloc = f"{role_name(service)}:{password}@{host}" + (f":{parts.port}" if parts.port else "")
    path = f"/{database}" if database else parts.path
    return urlunsplit(("postgresql+asyncpg", netloc, path, parts.query, ""))


async def ensure_database(admin_url: str, database: str) -> None:
    parts = urlsplit(to_plain_url(admin_url))
    maint = urlunsplit((parts.scheme, parts.netloc, "/postgres", parts.query, ""))
    conn = await asyncpg.connect(maint)
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database)
        if not exists:
            await conn.execute(f'CREATE DATABASE "{_ident(database)}"')
    finally:
        await conn.close()


async def ensure_service_schema(admin_url: str, service: str, password: str, schema: str | None = None) -> str:
    """Create/refresh the service role and schema; return the service's connection URL."""
    schema = _ident(schema or service)
    role = role_name(service)
    conn = await asyncpg.connect(to_plain_url(admin_url))
    try:
        async with conn.transaction():
            # Serialise concurrent provisioning of the same cluster (CREATE ROLE races otherwise).
            await conn.execute("SELECT pg_advisory_xact_lock(4242)")
            exists = await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role)
            verb = "ALTER" if exists else "CREATE"
            # Passwords cannot be bound as parameters in DDL; quote_literal does the escaping.
            pw = await conn.fetchval("SELECT quote_literal($1)", password)
            await conn.execute(f"{verb} ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD {pw}")
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema} AUTHORIZATION {role}")
            await conn.execute(f"ALTER SCHEMA {schema} OWNER TO {role}")
            await conn.execute(f"ALTER ROLE {role} SET search_path = {schema}")
            await conn.execute("REVOKE ALL ON SCHEMA public FROM PUBLIC")
            db = await conn.fetchval("SELECT current_database()")
            await conn.execute(f'REVOKE ALL ON DATABASE "{db}" FROM PUBLIC')
            await conn.execute(f'GRANT CONNECT ON DATABASE "{db}" TO {role}')
    finally:
        await conn.close()
    return service_url(admin_url, service, password)
