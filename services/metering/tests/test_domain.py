"""Metering rules without I/O: hourly windows, the meter lifecycle, the heartbeat rule, app usage windows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from gpuaas.metering.domain import Meter, MeterStatus, TransitionRefused, app_usage_window, suspend_point, windows

T0 = datetime(2026, 11, 21, 10, 15, tzinfo=UTC)


def test_windows_split_on_utc_hours_and_cover_the_interval_exactly() -> None:
    ws = windows(T0, T0 + timedelta(hours=2, minutes=10), 2)
    assert [(w.start.hour, w.start.minute, w.end.hour, w.end.minute) for w in ws] == [
        (10, 15, 11, 0),
        (11, 0, 12, 0),
        (12, 0, 12, 25),
    ]
    assert sum(w.gpu_seconds for w in ws) == Decimal(2 * (2 * 3600 + 600))
    assert windows(T0, T0, 1) == []
    full = windows(T0, T0 + timedelta(hours=2, minutes=10), 2, full_only=True)
    assert len(full) == 2 and full[-1].end == datetime(2026, 11, 21, 12, tzinfo=UTC)


def test_closer_records_only_full_hours_and_never_twice() -> None:
    m = Meter.open(T0, 4)
    first = m.record_full_windows(T0 + timedelta(hours=1))  # 11:15
    assert [(w.start, w.end) for w in first] == [(T0, datetime(2026, 11, 21, 11, tzinfo=UTC))]
    assert m.record_full_windows(T0 + timedelta(hours=1, minutes=40)) == []  # 11:55
    assert m.billed_until == datetime(2026, 11, 21, 11, tzinfo=UTC)
    assert m.next_window_end == datetime(2026, 11, 21, 12, tzinfo=UTC)


def test_resize_splits_the_window_at_the_change() -> None:
    m = Meter.open(T0, 2)
    ws = m.change(T0 + timedelta(minutes=20), 6)
    assert len(ws) == 1 and ws[0].gpu_count == 2 and ws[0].gpu_seconds == Decimal(2 * 1200)
    ws = m.close(T0 + timedelta(minutes=30), "release_requested")
    assert ws[0].gpu_count == 6 and ws[0].gpu_seconds == Decimal(6 * 600) and ws[0].final
    assert m.status is MeterStatus.closed


def test_close_stops_billing_and_a_closed_meter_refuses_everything() -> None:
    m = Meter.open(T0, 1)
    m.close(T0 + timedelta(minutes=5), "release_requested")
    with pytest.raises(TransitionRefused):
        m.close(T0 + timedelta(hours=5), "again")
    with pytest.raises(TransitionRefused):
        m.change(T0 + timedelta(hours=5), 3)
    assert m.record_full_windows(T0 + timedelta(hours=9)) == []


def test_a_stop_before_what_is_recorded_is_kept_as_late_seconds() -> None:
    m = Meter.open(T0, 2)
    m.record_full_windows(T0 + timedelta(hours=1))  # recorded up to 11:00
    ws = m.close(datetime(2026, 11, 21, 10, 50, tzinfo=UTC), "release_requested")
    assert ws == [] and m.late_stop_gpu_seconds == Decimal(2 * 600)


def test_heartbeat_rule_suspends_at_last_heartbeat_plus_grace_and_resumes_on_recovery() -> None:
    m = Meter.open(T0, 1)
    lost = T0 + timedelta(minutes=30)
    at = suspend_point(lost, timedelta(minutes=10))
    ws = m.suspend(at, "host_heartbeat_lost")
    assert sum(w.gpu_seconds for w in ws) == Decimal(40 * 60)
    assert m.status is MeterStatus.suspended and m.suspended_at == at
    assert m.record_full_windows(T0 + timedelta(hours=5)) == []  # nothing accrues while suspended
    m.resume(T0 + timedelta(hours=2))
    ws = m.close(T0 + timedelta(hours=2, minutes=5), "release_requested")
    assert sum(w.gpu_seconds for w in ws) == Decimal(5 * 60)


def test_app_usage_window_accepts_late_events_of_the_previous_hour_only() -> None:
    now = datetime(2026, 11, 21, 10, 20, tzinfo=UTC)
    w = app_usage_window(now, timedelta(hours=1), timedelta(minutes=5), now - timedelta(days=1), None)
    assert w.accepted_from == datetime(2026, 11, 21, 9, tzinfo=UTC)
    assert w.accepted_until == now + timedelta(minutes=5)
    ended = app_usage_window(
        now, timedelta(hours=1), timedelta(minutes=5), now - timedelta(days=1), now - timedelta(minutes=30)
    )
    assert ended.accepted_until == now - timedelta(minutes=25)
