"""A small async client of the public API. Errors come back as `ApiError` carrying the problem's code."""

from __future__ import annotations

from typing import Any

import httpx


class ApiError(Exception):
    """An RFC 9457 problem answered by the platform."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status = status
        self.problem = problem
        self.code: str = problem.get("code", "unknown")
        super().__init__(f"{status} {self.code}: {problem.get('detail', '')}")


class Client:
    def __init__(self, base_url: str, token: str | None = None, *, timeout_s: float = 30.0) -> None:
        self.token = token
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def login(self, email: str, password: str) -> str:
        data = await self.request("POST", "/api/identity/auth/token",
                                  data={"grant_type": "password", "username": email, "password": password},
                                  authenticated=False)
        self.token = data["access_token"]
        return self.token

    async def request(self, method: str, path: str, *, authenticated: bool = True,
                      idempotency_key: str | None = None, **kwargs: Any) -> Any:
        headers = dict(kwargs.pop("headers", {}) or {})
        if authenticated and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        response = await self._http.request(method, path, headers=headers, **kwargs)
        if response.status_code >= 400:
            try:
                problem = response.json()
            except ValueError:
                problem = {"code": "http_error", "detail": response.text[:500]}
            raise ApiError(response.status_code, problem)
        if response.status_code == 204 or not response.content:
            return None
        return response.json()

    # --- identity ---

    async def create_tenant(self, slug: str, name: str) -> dict[str, Any]:
        return await self.request("POST", "/api/identity/tenants", json={"slug": slug, "name": name})

    async def create_project(self, tenant_id: str, name: str) -> dict[str, Any]:
        return await self.request("POST", f"/api/identity/tenants/{tenant_id}/projects", json={"name": name})

    async def audit(self, **params: Any) -> dict[str, Any]:
        return await self.request("GET", "/api/identity/audit", params=params)

    # --- allocations ---

    async def enrol_host(self, name: str, gpus: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return await self.request("POST", "/api/allocations/hosts", json={"name": name, "gpus": gpus, **fields})
