"""What every API group of the client shares: the HTTP connection, bearer tokens (refreshed once after a 401
through `token_provider`), Idempotency-Key, and problem+json answers raised as `ApiError`."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Self

import httpx

Id = uuid.UUID | str  # every id argument: a UUID or its text
APP_RUNTIME = "/api/app-runtime"


class ApiError(Exception):
    """An RFC 9457 problem answered by the platform."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status = status
        self.problem = problem
        self.code: str = problem.get("code", "unknown")
        super().__init__(f"{status} {self.code}: {problem.get('detail', '')}")


class Transport:
    """`token` is a bearer token; `token_provider` (async, returns a fresh token) is used instead when set and
    called again once after a 401, so long-running controllers survive token expiry. `transport` lets tests
    run the client against an in-process app."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        token_provider: Callable[[], Awaitable[str]] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        prefix: str = APP_RUNTIME,
    ) -> None:
        self.token: str | None = token
        self.token_provider = token_provider
        self.ar = prefix  # where the app-runtime API lives ("/api/app-runtime" through the gateway)
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s, transport=transport)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(
        self, method: str, path: str, *, authenticated: bool = True, idempotency_key: str | None = None, **kwargs: Any
    ) -> Any:
        headers = dict(kwargs.pop("headers", {}) or {})
        if authenticated and self.token is None and self.token_provider is not None:
            self.token = await self.token_provider()
        if authenticated and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        response = await self._http.request(method, path, headers=headers, **kwargs)
        if response.status_code == 401 and authenticated and self.token_provider is not None:
            self.token = await self.token_provider()
            headers["Authorization"] = f"Bearer {self.token}"
            response = await self._http.request(method, path, headers=headers, **kwargs)
        if response.status_code >= 400:
            raise ApiError(response.status_code, problem_of(response))
        if response.status_code == 204 or not response.content:
            return None
        return response.json()


def problem_of(response: httpx.Response) -> dict[str, Any]:
    try:
        problem: dict[str, Any] = response.json()
        return problem
    except ValueError:
        return {"code": "http_error", "detail": response.text[:500]}


def s(value: Any) -> str | None:
    """An id (or None) as the API takes it."""
    return None if value is None else str(value)


def query(params: dict[str, Any]) -> dict[str, str]:
    """Query parameters without the unset ones."""
    return {k: str(v) for k, v in params.items() if v is not None}
