"""What a handler raises to tell the loop what to do next (kopf's `TemporaryError` / `PermanentError`)."""

from __future__ import annotations


class PermanentError(Exception):
    """Fail the operation now with this message (the member becomes `failed`; a person or `recover` acts)."""


# The name used before TemporaryError existed; the same thing.
OperationFailed = PermanentError


class TemporaryError(Exception):
    """Try again later: an operation handler is run again after `delay` seconds (or the loop's back-off)
    while its lease is kept, up to the loop's `max_temporary_retries`; a reconcile is requeued after it."""

    def __init__(self, message: str = "", *, delay: float | None = None) -> None:
        super().__init__(message)
        self.delay = delay


class Defer(Exception):
    """Not now, and not a failure (Juju's `event.defer()`): the operation is given back to the platform without
    counting as an attempt, and offered again after `delay` seconds (else the platform's maximum) or as soon as
    its instance changes (another operation finished, a member was reported). Raise it, or `ctx.defer(...)`,
    instead of sleeping on the lease (say a worker's add while its head is not up)."""

    def __init__(self, reason: str = "", *, delay: float | None = None) -> None:
        super().__init__(reason)
        self.delay = delay


class LeaseLost(Exception):
    """The platform no longer considers this replica the holder of the operation."""
