"""The client-visible errors (RFC 9457 problem details with stable codes), free of any web framework so that domain
rules can raise them; `gpuaas.kit.errors` renders them as problem+json."""

from __future__ import annotations

from typing import Any


class Problem(Exception):
    """A client-visible error: HTTP status + stable machine code + human detail."""

    status: int = 400
    code: str = "bad_request"
    title: str = "Bad request"

    def __init__(
        self,
        detail: str = "",
        *,
        code: str | None = None,
        status: int | None = None,
        title: str | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail or self.title)
        self.detail = detail or (title or self.title)
        self.code = code or self.code
        self.status = status or self.status
        self.title = title or self.title
        self.extra = extra


class NotFound(Problem):
    status, code, title = 404, "not_found", "Not found"


class Forbidden(Problem):
    status, code, title = 403, "forbidden", "Forbidden"


class Unauthorized(Problem):
    status, code, title = 401, "unauthorized", "Authentication required"


class Conflict(Problem):
    status, code, title = 409, "conflict", "Conflict"


class Unprocessable(Problem):
    status, code, title = 422, "validation_error", "Invalid request"


class PreconditionFailed(Problem):
    status, code, title = 412, "version_mismatch", "Resource changed since it was read"


class TooManyRequests(Problem):
    status, code, title = 429, "rate_limited", "Too many requests"


class Unavailable(Problem):
    status, code, title = 503, "unavailable", "Temporarily unavailable"
