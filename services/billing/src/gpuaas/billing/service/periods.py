"""Billing periods as the API names them ("YYYY-MM", UTC calendar months)."""

from __future__ import annotations

from datetime import UTC, datetime

from gpuaas.billing import domain
from gpuaas.kit.errors import Unprocessable


def parse_period(period: str | None) -> datetime:
    """The start of the named period, or of the current one when none is named."""
    if period is None:
        return domain.month_start(datetime.now(UTC))
    try:
        return domain.month_of(period)
    except ValueError:  # e.g. year 0000: matches the API's pattern but is no calendar month
        raise Unprocessable(f"{period!r} is not a calendar month", code="invalid_period") from None
