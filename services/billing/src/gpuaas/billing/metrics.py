"""Billing's business metrics (rating and the ledger), on the app's registry (`SPEC.metrics`); the kit adds
`service="billing"` to each sample.

- `gpuaas_usage_events_rated_total{kind}` and `gpuaas_usage_rating_delay_seconds` (usage event time →
  ledger posting) are recorded by the rating use case once its transaction commits (per process: `sum`);
- `gpuaas_usage_rating_lag_seconds` (the billing lag: age of the oldest received usage record that is not
  rated yet, 0 when none), `gpuaas_usage_unrated_records{kind}`, `gpuaas_ledger_imbalance{currency}`
  (debits - credits: must stay 0) and `gpuaas_ledger_unbalanced_transactions` are computed from the tables
  at scrape time (the same on every replica: aggregate with `max`). The ledger sums read every entry, so
  they are recomputed at most every `LEDGER_CHECK_INTERVAL_S`, not at every scrape.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuaas.billing.models import ledger_entries, usage_received
from gpuaas.kit.metrics import SLOW_BUCKETS, after_commit, metrics_of

LEDGER_CHECK_INTERVAL_S = 60.0
KINDS = ("gpu", "app")


class BillingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.rated = Counter(
            "gpuaas_usage_events_rated_total",
            "Usage records rated into the ledger (one balanced transaction and one charge each), by kind",
            ["kind"],
            registry=registry,
        )
        self.rating_delay = Histogram(
            "gpuaas_usage_rating_delay_seconds",
            "Time from a usage event (its event time) to its charge in the ledger",
            buckets=SLOW_BUCKETS,
            registry=registry,
        )
        self.rating_lag = Gauge(
            "gpuaas_usage_rating_lag_seconds",
            "Billing lag: age of the oldest received usage record not rated yet (0 when every record is rated)",
            registry=registry,
        )
        self.unrated = Gauge(
            "gpuaas_usage_unrated_records",
            "Usage records received and not rated yet (waiting for a price), by kind",
            ["kind"],
            registry=registry,
        )
        self.imbalance = Gauge(
            "gpuaas_ledger_imbalance",
            "Ledger debits minus credits, by currency: must stay 0",
            ["currency"],
            registry=registry,
        )
        self.unbalanced = Gauge(
            "gpuaas_ledger_unbalanced_transactions",
            "Ledger transactions whose debits and credits differ: must stay 0",
            registry=registry,
        )
        self._ledger_checked = -LEDGER_CHECK_INTERVAL_S  # the first scrape checks

    async def refresh(self, session: AsyncSession) -> None:
        oldest, at = (
            await session.execute(
                select(func.min(usage_received.c.received_at), func.now()).where(usage_received.c.status == "unrated")
            )
        ).one()
        unrated = dict(
            (
                await session.execute(
                    select(usage_received.c.usage_kind, func.count())
                    .where(usage_received.c.status == "unrated")
                    .group_by(usage_received.c.usage_kind)
                )
            ).all()
        )
        self.rating_lag.set(max((at - oldest).total_seconds(), 0.0) if oldest else 0.0)
        for kind in KINDS:
            self.unrated.labels(kind).set(unrated.get(kind, 0))
        if time.monotonic() - self._ledger_checked >= LEDGER_CHECK_INTERVAL_S:
            await self._check_ledger(session)
            self._ledger_checked = time.monotonic()

    async def _check_ledger(self, session: AsyncSession) -> None:
        debits = func.coalesce(func.sum(ledger_entries.c.amount).filter(ledger_entries.c.side == "debit"), 0)
        credits = func.coalesce(func.sum(ledger_entries.c.amount).filter(ledger_entries.c.side == "credit"), 0)
        per_currency = (
            await session.execute(
                select(ledger_entries.c.currency, debits - credits).group_by(ledger_entries.c.currency)
            )
        ).all()
        unbalanced = await session.scalar(
            select(func.count()).select_from(
                select(ledger_entries.c.transaction_id)
                .group_by(ledger_entries.c.transaction_id, ledger_entries.c.currency)
                .having(debits != credits)
                .subquery()
            )
        )
        for currency, difference in per_currency:
            self.imbalance.labels(currency).set(float(difference))
        self.unbalanced.set(unbalanced or 0)


def usage_rated(session: AsyncSession, rated: Sequence[tuple[str, datetime]], posted_at: datetime) -> None:
    """Records of (kind, event time) were charged at `posted_at`: counted once the transaction commits."""
    if not rated or not (m := metrics_of(session, BillingMetrics)):
        return

    def record(metrics: Any = m) -> None:
        for kind, event_time in rated:
            metrics.rated.labels(kind).inc()
            metrics.rating_delay.observe(max((posted_at - event_time).total_seconds(), 0.0))

    after_commit(session, record)
