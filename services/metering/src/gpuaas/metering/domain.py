"""Metering rules (no I/O): hourly usage windows, the meter lifecycle, and the heartbeat rule.

Meter lifecycle (transition table below):

    open ──change (resize)──▶ open
    open ──suspend (host heartbeat lost + grace)──▶ suspended ──resume (host back)──▶ open
    open | suspended ──close (release requested)──▶ closed            (final)

GPU time is recorded in windows `[start, end)` aligned to UTC hours: a window ends at the next hour
boundary, or earlier where the meter changes (resize), is suspended or closes. Each window is one usage
record whose id is `usage_record_id(allocation_id, window_start)`: windows of one meter never share a
start, so recomputing or replaying a window can only ever produce the same record.

The window closer records a full hour only once it is `settle` old (late lifecycle events can still
land inside it). A stop (resize, suspend, close) dated before what is already recorded cannot be
undone (usage records are immutable facts): the meter keeps the over-recorded GPU-seconds in
`late_stop_gpu_seconds` for operators to credit; the settle delay makes that rare.

Heartbeat rule: when allocations reports `host.heartbeat_lost`, allocations on that host keep being
metered for `grace` after the host's last heartbeat (a short network blip is not free), then the meter
is suspended AT `last_heartbeat + grace` with the reason visible on the meter. If the host comes back,
metering resumes at the recovery heartbeat; the unreachable time after the grace is never billed. A
release request while suspended closes the meter without billing the suspended time.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from enum import StrEnum

HOUR = timedelta(hours=1)
MICRO = Decimal("0.000001")


class MeterStatus(StrEnum):
    open = "open"
    suspended = "suspended"
    closed = "closed"


class MeterAction(StrEnum):
    change = "change"
    suspend = "suspend"
    resume = "resume"
    close = "close"
    record = "record"


TRANSITIONS: dict[tuple[MeterStatus, MeterAction], MeterStatus] = {
    (MeterStatus.open, MeterAction.record): MeterStatus.open,
    (MeterStatus.open, MeterAction.change): MeterStatus.open,
    (MeterStatus.suspended, MeterAction.change): MeterStatus.suspended,
    (MeterStatus.open, MeterAction.suspend): MeterStatus.suspended,
    (MeterStatus.suspended, MeterAction.resume): MeterStatus.open,
    (MeterStatus.open, MeterAction.close): MeterStatus.closed,
    (MeterStatus.suspended, MeterAction.close): MeterStatus.closed,
}


class TransitionRefused(Exception):
    def __init__(self, status: MeterStatus, action: MeterAction) -> None:
        super().__init__(f"a {status} meter cannot {action}")
        self.status, self.action = status, action


def utc(t: datetime) -> datetime:
    if t.tzinfo is None:
        raise ValueError("naive datetime")
    return t.astimezone(UTC)


def hour_floor(t: datetime) -> datetime:
    return utc(t).replace(minute=0, second=0, microsecond=0)


def next_boundary(t: datetime) -> datetime:
    return hour_floor(t) + HOUR


def gpu_seconds(gpu_count: int, start: datetime, end: datetime) -> Decimal:
    delta = end - start
    micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return (Decimal(gpu_count) * Decimal(micros) / Decimal(1_000_000)).quantize(MICRO)


@dataclass(frozen=True)
class Window:
    start: datetime
    end: datetime
    gpu_count: int
    final: bool = False

    @property
    def gpu_seconds(self) -> Decimal:
        return gpu_seconds(self.gpu_count, self.start, self.end)


def windows(start: datetime, end: datetime, gpu_count: int, *, full_only: bool = False) -> list[Window]:
    """Hour-aligned windows covering `[start, end)`; with `full_only`, only those ending on a boundary."""
    out: list[Window] = []
    s = utc(start)
    end = utc(end)
    while s < end:
        boundary = next_boundary(s)
        e = min(boundary, end)
        if full_only and e != boundary:
            break
        out.append(Window(s, e, gpu_count))
        s = e
    return out


@dataclass
class Meter:
    """The state of one allocation's meter; each method returns the usage windows it completes."""

    status: MeterStatus
    gpu_count: int
    opened_at: datetime
    billed_until: datetime
    changed_at: datetime | None = None
    closed_at: datetime | None = None
    close_reason: str | None = None
    suspended_at: datetime | None = None
    suspend_reason: str | None = None
    resumed_at: datetime | None = None
    late_stop_gpu_seconds: Decimal = field(default_factory=lambda: Decimal(0))

    @classmethod
    def open(cls, at: datetime, gpu_count: int) -> Meter:
        return cls(status=MeterStatus.open, gpu_count=gpu_count, opened_at=utc(at), billed_until=utc(at))

    @property
    def next_window_end(self) -> datetime | None:
        return next_boundary(self.billed_until) if self.status is MeterStatus.open else None

    def _transition(self, action: MeterAction) -> None:
        to = TRANSITIONS.get((self.status, action))
        if to is None:
            raise TransitionRefused(self.status, action)
        self.status = to

    def _advance_to(self, at: datetime) -> list[Window]:
        """Record everything up to `at` (an open meter); a stop dated before what is recorded is late."""
        at = utc(at)
        if self.status is not MeterStatus.open:
            return []
        if at < self.billed_until:
            self.late_stop_gpu_seconds += gpu_seconds(self.gpu_count, at, self.billed_until)
            return []
        out = windows(self.billed_until, at, self.gpu_count)
        self.billed_until = at
        return out

    def record_full_windows(self, until: datetime) -> list[Window]:
        """The window closer: full hours ending at or before `until` (= now - settle)."""
        if self.status is not MeterStatus.open:
            return []
        self._transition(MeterAction.record)
        out = windows(self.billed_until, utc(until), self.gpu_count, full_only=True)
        if out:
            self.billed_until = out[-1].end
        return out

    def change(self, at: datetime, gpu_count: int) -> list[Window]:
        self._transition(MeterAction.change)
        out = self._advance_to(at) if self.status is MeterStatus.open else []
        self.gpu_count = gpu_count
        self.changed_at = utc(at)
        return out

    def suspend(self, at: datetime, reason: str) -> list[Window]:
        out = self._advance_to(at)
        self._transition(MeterAction.suspend)
        self.suspended_at = self.billed_until
        self.suspend_reason = reason
        return out

    def resume(self, at: datetime) -> None:
        self._transition(MeterAction.resume)
        assert self.suspended_at is not None
        self.billed_until = max(utc(at), self.billed_until)
        self.resumed_at = self.billed_until

    def close(self, at: datetime, reason: str) -> list[Window]:
        if self.status is MeterStatus.open:
            out = self._advance_to(at)
        else:
            out = []
            if utc(at) < self.billed_until:  # closed before a suspension that was already recorded
                self.late_stop_gpu_seconds += gpu_seconds(self.gpu_count, utc(at), self.billed_until)
        self._transition(MeterAction.close)
        self.closed_at = utc(at)
        self.close_reason = reason
        if out:
            out[-1] = Window(out[-1].start, out[-1].end, out[-1].gpu_count, final=True)
        return out


def suspend_point(last_heartbeat_at: datetime, grace: timedelta) -> datetime:
    """Where billing stops for allocations on a host that stopped heartbeating."""
    return utc(last_heartbeat_at) + grace


def suspend_reason(host_name: str, last_heartbeat_at: datetime, grace: timedelta) -> str:
    return (
        f"host_heartbeat_lost: host {host_name} last heartbeat at {utc(last_heartbeat_at).isoformat()}; "
        f"billing stopped after the {int(grace.total_seconds())}s grace period"
    )


@dataclass(frozen=True)
class AppUsageWindow:
    """Which occurrence times an app usage post may carry (`accepted_from` <= t <= `accepted_until`)."""

    accepted_from: datetime
    accepted_until: datetime


def app_usage_window(
    now: datetime,
    late: timedelta,
    skew: timedelta,
    instance_created_at: datetime,
    instance_ended_at: datetime | None,
) -> AppUsageWindow:
    """Late events are accepted back to the start of the hourly window `late` ago (so a window stays open
    for at least `late` after it ends), never before the instance existed nor after it ended (+ skew),
    and never in the future beyond the clock skew."""
    now = utc(now)
    start = max(hour_floor(now - late), utc(instance_created_at) - skew)
    until = now + skew
    if instance_ended_at is not None:
        until = min(until, utc(instance_ended_at) + skew)
    return AppUsageWindow(start, until)


def instance_of_window(
    stays: Iterable[tuple[uuid.UUID, datetime | None, datetime | None]], start: datetime, end: datetime
) -> uuid.UUID | None:
    """The app instance a GPU window of an allocation counts for: the one instance with a member on the
    allocation during `[start, end)` (each stay is `(instance_id, joined_at, left_at)`); None when no app
    ran there or several did (the time is then no single instance's cost)."""
    found = {
        instance_id
        for instance_id, joined_at, left_at in stays
        if (joined_at is None or joined_at < end) and (left_at is None or left_at > start)
    }
    return found.pop() if len(found) == 1 else None
