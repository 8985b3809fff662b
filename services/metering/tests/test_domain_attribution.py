"""Metering rules without I/O beside test_domain: which app instance a GPU window counts for, a meter changed or
closed while suspended, the lifetime bounds of app usage, and timezone-aware time only."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from gpuaas.metering.domain import (
    Meter,
    MeterStatus,
    TransitionRefused,
    app_usage_window,
    gpu_seconds,
    instance_of_window,
    suspend_reason,
    windows,
)

T0 = datetime(2026, 11, 21, 10, 0, tzinfo=UTC)
T1 = T0 + timedelta(hours=1)
A, B = uuid.uuid4(), uuid.uuid4()


def at(minutes: int) -> datetime:
    return T0 + timedelta(minutes=minutes)


# ---------------------------------------------------------------------------------- instance attribution


def test_a_window_counts_for_the_one_instance_with_a_member_on_the_allocation() -> None:
    assert instance_of_window([(A, at(-30), None)], T0, T1) == A
    assert instance_of_window([(A, at(30), at(40))], T0, T1) == A  # any overlap counts
    assert instance_of_window([(A, None, None)], T0, T1) == A  # no recorded times: there throughout


def test_stays_that_only_touch_the_window_do_not_count() -> None:
    assert instance_of_window([(A, at(-60), T0)], T0, T1) is None  # left as the window started
    assert instance_of_window([(A, T1, None)], T0, T1) is None  # joined as it ended ([start, end))


def test_a_window_shared_by_two_instances_is_no_single_instances_cost() -> None:
    assert instance_of_window([(A, at(-10), at(20)), (B, at(30), None)], T0, T1) is None
    assert instance_of_window([], T0, T1) is None


def test_two_stays_of_the_same_instance_are_still_that_instance() -> None:
    assert instance_of_window([(A, at(-10), at(10)), (A, at(40), None), (B, at(-90), at(-30))], T0, T1) == A


# ------------------------------------------------------------------------------------- suspended meters


def test_a_resize_while_suspended_records_nothing_and_applies_from_the_resume() -> None:
    m = Meter.open(T0, 2)
    m.suspend(at(10), "host_heartbeat_lost")
    assert m.change(at(20), 8) == []
    assert m.status is MeterStatus.suspended
    m.resume(at(30))
    (window,) = m.close(at(45), "release_requested")
    assert (window.start, window.gpu_count, window.gpu_seconds) == (at(30), 8, Decimal(8 * 15 * 60))


def test_a_release_while_suspended_bills_nothing_after_the_suspension() -> None:
    m = Meter.open(T0, 4)
    recorded = m.suspend(at(10), "host_heartbeat_lost")
    assert sum(w.gpu_seconds for w in recorded) == Decimal(4 * 600)
    assert m.close(at(50), "release_requested") == []
    assert m.status is MeterStatus.closed and m.late_stop_gpu_seconds == 0


def test_a_release_dated_before_a_recorded_suspension_keeps_the_overlap_as_late_seconds() -> None:
    m = Meter.open(T0, 4)
    m.suspend(at(10), "host_heartbeat_lost")
    m.close(at(4), "release_requested")  # the release was requested before billing stopped
    assert m.late_stop_gpu_seconds == Decimal(4 * 6 * 60)


def test_a_suspended_meter_cannot_be_suspended_again_nor_an_open_one_resumed() -> None:
    m = Meter.open(T0, 1)
    with pytest.raises(TransitionRefused):
        m.resume(at(5))
    m.suspend(at(10), "host_heartbeat_lost")
    with pytest.raises(TransitionRefused):
        m.suspend(at(20), "again")


def test_a_resume_dated_before_the_suspension_does_not_bill_twice() -> None:
    m = Meter.open(T0, 1)
    m.suspend(at(30), "host_heartbeat_lost")
    m.resume(at(20))  # a recovery heartbeat that raced the suspension
    (window,) = m.close(at(40), "release_requested")
    assert window.start == at(30) and window.gpu_seconds == Decimal(600)


def test_the_suspend_reason_says_which_host_when_and_the_grace() -> None:
    reason = suspend_reason("gpu-07", at(15), timedelta(minutes=10))
    assert reason.startswith("host_heartbeat_lost:")
    assert "gpu-07" in reason and "2026-11-21T10:15:00+00:00" in reason and "600s" in reason


# ----------------------------------------------------------------------------------------- app usage


def test_app_usage_is_accepted_only_while_the_instance_existed_give_or_take_the_skew() -> None:
    now = at(20)
    skew = timedelta(minutes=5)
    created = at(10)  # younger than the late window: its creation bounds it
    w = app_usage_window(now, timedelta(hours=1), skew, created, None)
    assert w.accepted_from == created - skew
    ended = app_usage_window(now, timedelta(hours=1), skew, created, at(15))
    assert ended.accepted_until == at(15) + skew


# -------------------------------------------------------------------------------------------- time


def test_naive_times_are_refused_and_other_zones_are_converted() -> None:
    with pytest.raises(ValueError, match="naive"):
        Meter.open(datetime(2026, 11, 21, 10, 0), 1)  # no tzinfo: the point of the test
    paris = timezone(timedelta(hours=1))
    ws = windows(datetime(2026, 11, 21, 11, 30, tzinfo=paris), datetime(2026, 11, 21, 12, 30, tzinfo=paris), 1)
    assert [(w.start, w.end) for w in ws] == [(at(30), T1), (T1, T1 + timedelta(minutes=30))]
    assert all(w.start.tzinfo is UTC for w in ws)


def test_gpu_seconds_keep_microseconds() -> None:
    assert gpu_seconds(3, T0, T0 + timedelta(seconds=1, microseconds=1)) == Decimal("3.000003")
    assert gpu_seconds(2, T0, T0 + timedelta(days=2)) == Decimal(2 * 2 * 86_400)
