"""Billing rules (no I/O): SKUs, billing periods, rating, ledger postings and budget thresholds.

- SKU of GPU time: `gpu-hour.<gpu_model>.<shape>`, priced per GPU-hour; of app usage:
  `app.<app_slug>.<unit>`, priced per unit. A price applies to usage that *started* in its
  `[effective_from, effective_to)`.
- Money is Decimal with an explicit ISO 4217 currency; amounts are kept to 6 decimal places
  (ROUND_HALF_EVEN) in the ledger, so a statement total is the exact sum of its charges.
- Each charge is one balanced ledger transaction: debit the tenant's receivable account, credit the
  SKU's revenue account, same amount and currency.
- Periods are UTC calendar months. A charge counts in the period its usage started in; once a
  tenant's statement for that period is closed, a late charge counts in the period it was posted in
  (never rewriting a closed statement).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal

from gpuaas.contracts.events.billing import PriceUnit

AMOUNT_Q = Decimal("0.000001")
QTY_Q = Decimal("0.000000001")
SECONDS_PER_HOUR = Decimal(3600)


def gpu_sku(gpu_model: str, shape: str) -> str:
    return f"gpu-hour.{gpu_model}.{shape}"


def app_sku(app_slug: str, unit: str) -> str:
    return f"app.{app_slug}.{unit}"


def month_start(t: datetime) -> datetime:
    t = t.astimezone(UTC)
    return t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def month_of(period: str) -> datetime:
    """The start of a "YYYY-MM" billing period; ValueError for one that is no calendar month (e.g. 0000-01)."""
    year, month = period.split("-")
    return datetime(int(year), int(month), 1, tzinfo=UTC)


def next_month(t: datetime) -> datetime:
    s = month_start(t)
    return s.replace(year=s.year + 1, month=1) if s.month == 12 else s.replace(month=s.month + 1)


@dataclass(frozen=True)
class Rated:
    quantity: Decimal  # in the price's unit (GPU-hours, tokens, ...)
    amount: Decimal


def rate(unit: PriceUnit | str, raw_quantity: Decimal, unit_price: Decimal) -> Rated:
    """`raw_quantity` is GPU-seconds for GPU time, else app units."""
    if PriceUnit(unit) is PriceUnit.gpu_hour:
        amount = raw_quantity * unit_price / SECONDS_PER_HOUR
        quantity = raw_quantity / SECONDS_PER_HOUR
    else:
        amount = raw_quantity * unit_price
        quantity = raw_quantity
    return Rated(quantity.quantize(QTY_Q, ROUND_HALF_EVEN), amount.quantize(AMOUNT_Q, ROUND_HALF_EVEN))


def receivable_account(tenant_id: uuid.UUID) -> str:
    return f"receivable:tenant:{tenant_id}"


def revenue_account(sku: str) -> str:
    return f"revenue:{sku}"


def postings(tenant_id: uuid.UUID, sku: str, amount: Decimal) -> list[tuple[str, str, Decimal]]:
    """(account, side, amount) of one charge: balanced by construction."""
    return [(receivable_account(tenant_id), "debit", amount), (revenue_account(sku), "credit", amount)]


def crossed_thresholds(limit: Decimal, before: Decimal, after: Decimal, thresholds: list[int]) -> list[int]:
    """Thresholds (percent of `limit`) that spend reached going from `before` to `after`."""
    return [t for t in sorted(thresholds) if after * 100 >= limit * t and before * 100 < limit * t]


def reached_thresholds(limit: Decimal, spent: Decimal, thresholds: list[int]) -> list[int]:
    return [t for t in sorted(thresholds) if spent * 100 >= limit * t]
