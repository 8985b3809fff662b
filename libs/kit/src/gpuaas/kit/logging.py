"""JSON logs (structlog) with correlation id, tenant and actor merged from context variables."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


# Both write to whatever sys.stderr is at the time of writing, not the stream it was when configured: a test
# runner (pytest's capture) or a supervisor may swap sys.stderr, and a stream bound at configure time may be
# closed by the time a later log line is written ("I/O operation on closed file").
def _stderr_logger(*_args: object) -> structlog.PrintLogger:
    return structlog.PrintLogger(sys.stderr)


class _StderrHandler(logging.StreamHandler[TextIO]):
    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # the current one (under the handler's lock), not the one at configure time
        super().emit(record)


def configure_logging(service: str, level: str = "INFO", json: bool = True) -> None:
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)
    # Route stdlib loggers (uvicorn, aiokafka, sqlalchemy) through the same JSON renderer.
    handler = _StderrHandler()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiokafka", "uvicorn.access", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
