"""`domain.window_use`: the peak and time-weighted mean of GPUs held over a window, without I/O."""

from __future__ import annotations

import pytest

from gpuaas.allocations.domain import Holding, window_use


def test_an_allocation_between_two_samples_shows_in_the_window() -> None:
    # Placed at 10 s and released at 40 s: held at neither sample (0 and 100), but the window sees it.
    peak, mean = window_use([Holding(4, 10, 40)], 0, 100)
    assert (peak, mean) == (4, pytest.approx(4 * 30 / 100))


def test_peak_counts_overlaps_and_a_handover_once() -> None:
    held = [
        Holding(2, -50, None),  # held before the window and still held
        Holding(3, 20, 60),
        Holding(1, 30, 50),  # overlaps the previous: 2 + 3 + 1 at once
        Holding(3, 60, 80),  # takes over at the instant the 3 are released: not 2 + 3 + 3
    ]
    peak, mean = window_use(held, 0, 100)
    assert peak == 6
    assert mean == pytest.approx((2 * 100 + 3 * 40 + 1 * 20 + 3 * 20) / 100)


def test_holdings_outside_the_window_count_nothing() -> None:
    held = [Holding(8, -30, -10), Holding(8, 100, None), Holding(1, 0, 0.5)]
    peak, mean = window_use(held, 0, 100)  # (0, 100]: one released at 0 ... the one placed at 100 counts at 100
    assert peak == 8 and mean == pytest.approx(0.5 / 100)


def test_an_empty_window_is_refused() -> None:
    with pytest.raises(ValueError):
        window_use([], 5, 5)
