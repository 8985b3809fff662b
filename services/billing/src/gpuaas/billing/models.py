"""Billing's tables (schema `billing`): the price book, received usage, the append-only double-entry
ledger (transactions + entries + the charge each transaction books), spend rollups, budgets, periods
and statements.

Database-level guarantees (see migrations): a usage record is charged at most once
(`uq_ledger_transactions_usage_record_id`); every ledger transaction balances (sum of debits == sum of
credits, per currency, checked by a deferred constraint trigger at commit); ledger rows are append-only
(UPDATE/DELETE/TRUNCATE raise)."""

from __future__ import annotations

from sqlalchemy import (
    ARRAY,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Numeric,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

from gpuaas.kit.db import NAMING_CONVENTION

metadata = MetaData(naming_convention=NAMING_CONVENTION)

MONEY = Numeric(24, 6)
QTY = Numeric(28, 9)

prices = Table(
    "prices",
    metadata,
    Column("price_id", UUID(as_uuid=True), primary_key=True),
    Column("sku", Text, nullable=False),
    Column("description", Text, nullable=False, server_default=""),
    Column("unit", Text, nullable=False),
    Column("unit_price", Numeric(24, 9), nullable=False),
    Column("currency", Text, nullable=False),
    Column("gpu_model", Text),
    Column("shape", Text),
    Column("app_slug", Text),
    Column("effective_from", DateTime(timezone=True), nullable=False),
    Column("effective_to", DateTime(timezone=True)),
    Column("created_by", Text),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    UniqueConstraint("sku", "effective_from", name="uq_prices_sku_effective_from"),
    CheckConstraint("unit_price >= 0", name="unit_price"),
    CheckConstraint("currency ~ '^[A-Z]{3}$'", name="currency"),
    CheckConstraint("effective_to IS NULL OR effective_to > effective_from", name="effective_range"),
)

# Every usage record billing has received, rated or waiting for a price (the SKU had none at that time).
usage_received = Table(
    "usage_received",
    metadata,
    Column("usage_record_id", UUID(as_uuid=True), primary_key=True),
    Column("usage_kind", Text, nullable=False),  # gpu | app
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("project_id", UUID(as_uuid=True), nullable=False),
    Column("sku", Text, nullable=False),
    Column("unit", Text, nullable=False),
    Column("raw_quantity", QTY, nullable=False),  # gpu-seconds or app units
    Column("usage_start", DateTime(timezone=True), nullable=False),
    Column("usage_end", DateTime(timezone=True), nullable=False),
    Column("allocation_id", UUID(as_uuid=True)),
    Column("instance_id", UUID(as_uuid=True)),
    Column("app_slug", Text),
    Column("status", Text, nullable=False),  # unrated | rated
    Column("event_time", DateTime(timezone=True), nullable=False),
    Column("received_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)
Index("ix_usage_received_unrated", usage_received.c.sku, postgresql_where=usage_received.c.status == "unrated")

ledger_transactions = Table(
    "ledger_transactions",
    metadata,
    Column("transaction_id", UUID(as_uuid=True), primary_key=True),
    Column("usage_record_id", UUID(as_uuid=True), nullable=False, unique=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("currency", Text, nullable=False),
    Column("memo", Text, nullable=False),
    Column("posted_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

ledger_entries = Table(
    "ledger_entries",
    metadata,
    Column("entry_id", UUID(as_uuid=True), primary_key=True),
    Column("transaction_id", UUID(as_uuid=True), ForeignKey("ledger_transactions.transaction_id"), nullable=False),
    Column("account", Text, nullable=False),
    Column("side", Text, nullable=False),
    Column("amount", MONEY, nullable=False),
    Column("currency", Text, nullable=False),
    CheckConstraint("side IN ('debit', 'credit')", name="side"),
    CheckConstraint("amount >= 0", name="amount"),
)
Index("ix_ledger_entries_transaction", ledger_entries.c.transaction_id)

# What each ledger transaction books: the rated usage record (one per transaction, append-only).
charges = Table(
    "charges",
    metadata,
    Column("charge_id", UUID(as_uuid=True), primary_key=True),
    Column("transaction_id", UUID(as_uuid=True), ForeignKey("ledger_transactions.transaction_id"), nullable=False),
    Column("usage_record_id", UUID(as_uuid=True), nullable=False, unique=True),
    Column("usage_kind", Text, nullable=False),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("project_id", UUID(as_uuid=True), nullable=False),
    Column("sku", Text, nullable=False),
    Column("price_id", UUID(as_uuid=True), nullable=False),
    Column("quantity", QTY, nullable=False),
    Column("unit", Text, nullable=False),
    Column("unit_price", Numeric(24, 9), nullable=False),
    Column("amount", MONEY, nullable=False),
    Column("currency", Text, nullable=False),
    Column("allocation_id", UUID(as_uuid=True)),
    Column("instance_id", UUID(as_uuid=True)),
    Column("app_slug", Text),
    Column("usage_start", DateTime(timezone=True), nullable=False),
    Column("usage_end", DateTime(timezone=True), nullable=False),
    Column("period_start", DateTime(timezone=True), nullable=False),
    Column("posted_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)
Index("ix_charges_tenant_period", charges.c.tenant_id, charges.c.period_start)

# Spend per tenant x project x period x currency, kept with each charge (budgets and cost views read it).
spend = Table(
    "spend",
    metadata,
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("project_id", UUID(as_uuid=True), nullable=False),
    Column("period_start", DateTime(timezone=True), nullable=False),
    Column("currency", Text, nullable=False),
    Column("gpu_amount", MONEY, nullable=False, server_default="0"),
    Column("app_amount", MONEY, nullable=False, server_default="0"),
    PrimaryKeyConstraint("tenant_id", "project_id", "period_start", "currency", name="pk_spend"),
)

# A tenant's billing period; charges take it FOR SHARE, closing a statement FOR UPDATE.
periods = Table(
    "periods",
    metadata,
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("period_start", DateTime(timezone=True), nullable=False),
    Column("status", Text, nullable=False, server_default="open"),
    Column("closed_at", DateTime(timezone=True)),
    PrimaryKeyConstraint("tenant_id", "period_start", name="pk_periods"),
    CheckConstraint("status IN ('open', 'closed')", name="status"),
)

statements = Table(
    "statements",
    metadata,
    Column("statement_id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("period_start", DateTime(timezone=True), nullable=False),
    Column("period_end", DateTime(timezone=True), nullable=False),
    Column("currency", Text, nullable=False),
    Column("total_amount", MONEY, nullable=False),
    Column("lines", JSONB, nullable=False),
    Column("closed_at", DateTime(timezone=True), nullable=False),
    UniqueConstraint("tenant_id", "period_start", "currency", name="uq_statements_tenant_period_currency"),
)

budgets = Table(
    "budgets",
    metadata,
    Column("budget_id", UUID(as_uuid=True), primary_key=True),
    Column("tenant_id", UUID(as_uuid=True), nullable=False),
    Column("project_id", UUID(as_uuid=True)),
    Column("name", Text, nullable=False, server_default=""),
    Column("limit_amount", MONEY, nullable=False),
    Column("currency", Text, nullable=False),
    Column("thresholds", ARRAY(Integer), nullable=False),
    Column("created_by", Text),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    CheckConstraint("limit_amount > 0", name="limit_amount"),
)
Index("ix_budgets_tenant", budgets.c.tenant_id)

budget_alerts = Table(
    "budget_alerts",
    metadata,
    Column("budget_id", UUID(as_uuid=True), ForeignKey("budgets.budget_id"), nullable=False),
    Column("period_start", DateTime(timezone=True), nullable=False),
    Column("threshold_percent", Integer, nullable=False),
    Column("spent_amount", MONEY, nullable=False),
    Column("crossed_at", DateTime(timezone=True), nullable=False),
    PrimaryKeyConstraint("budget_id", "period_start", "threshold_percent", name="pk_budget_alerts"),
)
