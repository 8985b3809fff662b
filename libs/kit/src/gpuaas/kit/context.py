"""Request/message context carried across await points: correlation id, causation, actor, tenant.

Set by the HTTP middleware and by the consumer while a handler runs; read by the outbox (so
events inherit them), the audit emitter and the JSON logger.
"""

from __future__ import annotations

import uuid
from collections.abc import Generator
from contextlib import contextmanager
from contextvars import ContextVar

import structlog

correlation_id: ContextVar[str | None] = ContextVar("correlation_id", default=None)
causation_id: ContextVar[uuid.UUID | None] = ContextVar("causation_id", default=None)


def new_correlation_id() -> str:
    return uuid.uuid4().hex


@contextmanager
def bound(
    *, correlation: str | None, causation: uuid.UUID | None = None, **log_fields: object
) -> Generator[None, None, None]:
    """Bind correlation/causation for the duration of a request or handled event."""
    t1 = correlation_id.set(correlation)
    t2 = causation_id.set(causation)
    with structlog.contextvars.bound_contextvars(correlation_id=correlation, **log_fields):
        try:
            yield
        finally:
            correlation_id.reset(t1)
            causation_id.reset(t2)
