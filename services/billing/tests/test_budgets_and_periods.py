"""Billing rules without I/O beside rating (test_domain): budget thresholds, UTC calendar months across time zones,
and the periods the API accepts (gpuaas.billing.service.periods)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from gpuaas.billing.domain import app_sku, crossed_thresholds, gpu_sku, month_start, reached_thresholds
from gpuaas.billing.service.periods import parse_period
from gpuaas.kit.problems import Problem

LIMIT = Decimal("200.00")
THRESHOLDS = [100, 50, 80]  # as stored: any order


def test_a_threshold_is_reached_at_exactly_its_share_of_the_limit() -> None:
    assert reached_thresholds(LIMIT, Decimal("99.999999"), THRESHOLDS) == []
    assert reached_thresholds(LIMIT, Decimal("100.00"), THRESHOLDS) == [50]
    assert reached_thresholds(LIMIT, Decimal("160.00"), THRESHOLDS) == [50, 80]
    assert reached_thresholds(LIMIT, Decimal("250.00"), THRESHOLDS) == [50, 80, 100]  # overspend reaches them all


def test_a_charge_crosses_only_the_thresholds_between_the_spend_before_and_after_it() -> None:
    assert crossed_thresholds(LIMIT, Decimal("90"), Decimal("170"), THRESHOLDS) == [50, 80]
    assert crossed_thresholds(LIMIT, Decimal("100"), Decimal("150"), THRESHOLDS) == []  # 50% was reached before
    assert crossed_thresholds(LIMIT, Decimal("99.99"), Decimal("100"), THRESHOLDS) == [50]
    assert crossed_thresholds(LIMIT, Decimal("150"), Decimal("400"), THRESHOLDS) == [80, 100]


def test_thresholds_over_100_percent_count_overspend() -> None:
    assert reached_thresholds(LIMIT, Decimal("240"), [120]) == [120]
    assert reached_thresholds(LIMIT, Decimal("239.99"), [120]) == []


def test_a_month_starts_at_midnight_utc_whatever_the_time_zone_of_the_instant() -> None:
    tokyo = timezone(timedelta(hours=9))
    # 1 March 08:00 in Tokyo is still February in UTC
    assert month_start(datetime(2026, 3, 1, 8, 0, tzinfo=tokyo)) == datetime(2026, 2, 1, tzinfo=UTC)
    assert month_start(datetime(2026, 3, 1, 9, 0, tzinfo=tokyo)) == datetime(2026, 3, 1, tzinfo=UTC)
    assert month_start(datetime(2026, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)) == datetime(2026, 12, 1, tzinfo=UTC)


def test_skus_name_what_is_priced() -> None:
    assert gpu_sku("H100-80GB", "gpu_slice") == "gpu-hour.H100-80GB.gpu_slice"
    assert app_sku("vllm", "tokens") == "app.vllm.tokens"


def test_a_named_period_is_its_first_instant() -> None:
    assert parse_period("2026-02") == datetime(2026, 2, 1, tzinfo=UTC)
    assert parse_period("2000-01") == datetime(2000, 1, 1, tzinfo=UTC)
    assert parse_period("2199-12") == datetime(2199, 12, 1, tzinfo=UTC)


def test_no_period_is_the_current_month() -> None:
    before = month_start(datetime.now(UTC))
    got = parse_period(None)
    assert got in (before, month_start(datetime.now(UTC)))  # a month may turn between the two reads
    assert got.tzinfo is UTC and got.day == 1


@pytest.mark.parametrize(
    ("period", "code"),
    [
        ("0000-01", "invalid_period"),  # matches YYYY-MM but is no calendar month
        ("2026-13", "invalid_period"),
        ("2026-00", "invalid_period"),
        ("1999-12", "period_out_of_range"),
        ("2200-01", "period_out_of_range"),
        ("9999-12", "period_out_of_range"),  # has no next month: must not reach date arithmetic
    ],
)
def test_periods_outside_the_calendar_or_the_range_are_422(period: str, code: str) -> None:
    with pytest.raises(Problem) as caught:
        parse_period(period)
    assert (caught.value.status, caught.value.code) == (422, code)
