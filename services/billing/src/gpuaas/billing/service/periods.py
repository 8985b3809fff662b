"""Billing periods as the API names them ("YYYY-MM", UTC calendar months)."""

from __future__ import annotations

from datetime import UTC, datetime

from gpuaas.billing import domain
from gpuaas.contracts.scalars import PERIOD_MAX_YEAR, PERIOD_MIN_YEAR
from gpuaas.kit.errors import Unprocessable


def parse_period(period: str | None) -> datetime:
    """The start of the named period, or of the current one when none is named."""
    if period is None:
        return domain.month_start(datetime.now(UTC))
    try:
        start = domain.month_of(period)
    except ValueError:  # e.g. year 0000: matches the API's pattern but is no calendar month
        raise Unprocessable(f"{period!r} is not a calendar month", code="invalid_period") from None
    # The API's BillingPeriod already bounds the year; a caller inside the service (or a future route that
    # forgets the type) must not reach date arithmetic that overflows (9999-12 has no next month).
    if not PERIOD_MIN_YEAR <= start.year <= PERIOD_MAX_YEAR:
        raise Unprocessable(
            f"billing periods run from {PERIOD_MIN_YEAR}-01 to {PERIOD_MAX_YEAR}-12", code="period_out_of_range"
        )
    return start
