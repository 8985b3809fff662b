"""Allocations' tables (schema `allocations`). Hosts first; allocations, timeline, keys and grants follow."""

from __future__ import annotations

from sqlalchemy import Column, DateTime, Integer, MetaData, Table, Text, func
from sqlalchemy.dialects.postgresql import JSONB, UUID

from gpuaas.kit.db import NAMING_CONVENTION

metadata = MetaData(naming_convention=NAMING_CONVENTION)

hosts = Table(
    "hosts",
    metadata,
    Column("host_id", UUID(as_uuid=True), primary_key=True),
    Column("name", Text, nullable=False, unique=True),
    Column("status", Text, nullable=False),
    Column("host_class", Text),
    Column("labels", JSONB, nullable=False, server_default="{}"),
    Column("gpus", JSONB, nullable=False, server_default="[]"),
    # Only a hash of the node token is kept; the agent presents the token to register.
    Column("node_token_hash", Text, nullable=False),
    Column("version", Integer, nullable=False, server_default="1"),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)
