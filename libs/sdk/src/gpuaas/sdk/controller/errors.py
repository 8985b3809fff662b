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


class LeaseLost(Exception):
    """The platform no longer considers this replica the holder of the operation."""
