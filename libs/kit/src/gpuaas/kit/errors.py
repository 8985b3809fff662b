"""RFC 9457 problem details with stable codes, and the handlers that render every error as one.

Domain code raises `Problem` subclasses (or `Problem(...)` directly); nothing else reaches a client
as a 500 except a genuine bug, which still renders as problem+json without internals.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuaas.kit import context
from gpuaas.kit.logging import get_logger
from gpuaas.kit.problems import (  # re-exported: routers and use cases import them from here
    Conflict,
    Forbidden,
    NotFound,
    PreconditionFailed,
    Problem,
    TooManyRequests,
    Unauthorized,
    Unavailable,
    Unprocessable,
)

__all__ = [
    "PROBLEM_JSON",
    "Conflict",
    "Forbidden",
    "NotFound",
    "PreconditionFailed",
    "Problem",
    "TooManyRequests",
    "Unauthorized",
    "Unavailable",
    "Unprocessable",
    "install_error_handlers",
    "problem_body",
    "problem_response",
]
PROBLEM_JSON = "application/problem+json"
log = get_logger(__name__)


def problem_body(
    status: int, code: str, title: str, detail: str, instance: str | None = None, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": f"https://gpuaas.dev/problems/{code}",
        "title": title,
        "status": status,
        "detail": detail,
        "code": code,
    }
    if instance:
        body["instance"] = instance
    if cid := context.correlation_id.get():
        body["correlation_id"] = cid
    body.update(extra)
    return body


def problem_response(
    status: int, code: str, title: str, detail: str, instance: str | None = None, **extra: Any
) -> JSONResponse:
    # A problem that knows how long to wait (`retry_after_s`) says so in the header too.
    headers = {"Retry-After": str(extra.get("retry_after_s", 1))} if status in (429, 503) else None
    return JSONResponse(
        problem_body(status, code, title, detail, instance, **extra),
        status_code=status,
        media_type=PROBLEM_JSON,
        headers=headers,
    )


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "validation_error",
    429: "rate_limited",
}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> JSONResponse:
        return problem_response(exc.status, exc.code, exc.title, exc.detail, request.url.path, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()
        ]
        return problem_response(
            422,
            "validation_error",
            "Invalid request",
            "The request failed validation.",
            request.url.path,
            errors=errors,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return problem_response(
            exc.status_code, code, code.replace("_", " ").capitalize(), str(exc.detail), request.url.path
        )

    @app.exception_handler(IntegrityError)
    async def _integrity(request: Request, exc: IntegrityError) -> JSONResponse:
        log.info("integrity_error", error=str(exc.orig))
        return problem_response(
            409, "conflict", "Conflict", "The change conflicts with existing data.", request.url.path
        )

    @app.exception_handler(OperationalError)
    @app.exception_handler(DBAPIError)
    async def _db(request: Request, exc: DBAPIError) -> JSONResponse:
        sqlstate = str(getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None) or "")
        if sqlstate.startswith("22"):  # data exception: a value Postgres cannot store (NUL byte, out of range)
            log.info("data_exception", sqlstate=sqlstate, error=str(exc.orig)[:500])
            return problem_response(
                422,
                "invalid_value",
                "Invalid value",
                "A value in the request cannot be stored (e.g. a NUL character or a number out of range).",
                request.url.path,
            )
        log.warning("database_unavailable", error=str(exc))
        return problem_response(
            503,
            "database_unavailable",
            "Database unavailable",
            "The database is unavailable; retry shortly.",
            request.url.path,
        )

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled_error")
        return problem_response(
            500,
            "internal_error",
            "Internal error",
            "An unexpected error occurred; it has been logged.",
            request.url.path,
        )
