"""Billing rules without I/O: rating rounds amounts half-even to 6 decimals and quantities to 9; periods."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from gpuaas.billing.domain import month_of, next_month, postings, rate
from gpuaas.contracts.events.billing import PriceUnit


@pytest.mark.parametrize(
    ("tokens", "amount"),
    [("1", "0.000000"), ("3", "0.000002"), ("5", "0.000002"), ("7", "0.000004"), ("9", "0.000004")],
)
def test_app_usage_amounts_round_ties_to_the_even_micro_unit(tokens: str, amount: str) -> None:
    rated = rate(PriceUnit.tokens, Decimal(tokens), Decimal("0.0000005"))  # each an exact tie at the 7th decimal
    assert rated.amount == Decimal(amount) and rated.quantity == Decimal(tokens)


def test_gpu_time_is_rated_per_hour_with_the_quantity_in_gpu_hours() -> None:
    rated = rate(PriceUnit.gpu_hour, Decimal(1), Decimal("2.50"))  # one GPU-second
    assert rated.amount == Decimal("0.000694") and rated.quantity == Decimal("0.000277778")
    # 5 GPU-seconds at 0.00036/h = 0.0000005: a tie, to the even 0.000000 (half-up would say 0.000001)
    assert rate(PriceUnit.gpu_hour, Decimal(5), Decimal("0.00036")).amount == Decimal("0.000000")
    assert rate(PriceUnit.gpu_hour, Decimal(3600), Decimal("2.50")).amount == Decimal("2.500000")


def test_a_charge_posts_one_balanced_pair() -> None:
    lines = postings(uuid.UUID(int=1), "gpu-hour.H100-80GB.gpu_slice", Decimal("1.25"))
    assert sum(a for _, side, a in lines if side == "debit") == sum(a for _, side, a in lines if side == "credit")


def test_periods_are_utc_calendar_months() -> None:
    assert month_of("2026-12") == datetime(2026, 12, 1, tzinfo=UTC)
    assert next_month(month_of("2026-12")) == datetime(2027, 1, 1, tzinfo=UTC)
    with pytest.raises(ValueError):
        month_of("0000-01")
