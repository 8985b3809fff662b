"""A small async client of the public API. Errors come back as `ApiError` carrying the problem's code."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from gpuaas.sdk.models import (
    Claim,
    Credential,
    CredentialSecret,
    Instance,
    Member,
    Operation,
    PlacementIntent,
    TimelineEntry,
)

AR = "/api/app-runtime"


class ApiError(Exception):
    """An RFC 9457 problem answered by the platform."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status = status
        self.problem = problem
        self.code: str = problem.get("code", "unknown")
        super().__init__(f"{status} {self.code}: {problem.get('detail', '')}")


class Client:
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
        prefix: str = AR,
    ) -> None:
        self.token = token
        self.token_provider = token_provider
        self.ar = prefix  # where the app-runtime API lives ("/api/app-runtime" through the gateway)
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s, transport=transport)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def login(self, email: str, password: str) -> str:
        data = await self.request(
            "POST",
            "/api/identity/auth/token",
            data={"grant_type": "password", "username": email, "password": password},
            authenticated=False,
        )
        self.token = data["access_token"]
        return self.token

    async def login_client(self, client_id: str, client_secret: str, scope: str | None = None) -> str:
        """`client_credentials` for a project service account (e.g. an app controller)."""
        form = {"grant_type": "client_credentials", "client_id": client_id, "client_secret": client_secret}
        if scope:
            form["scope"] = scope
        data = await self.request("POST", "/api/identity/auth/token", data=form, authenticated=False)
        self.token = data["access_token"]
        return self.token

    def use_client_credentials(self, client_id: str, client_secret: str, scope: str | None = None) -> None:
        """Fetch a fresh service-account token whenever the current one is missing or rejected (401)."""

        async def provider() -> str:
            async with httpx.AsyncClient(base_url=str(self._http.base_url), timeout=30) as http:
                form = {"grant_type": "client_credentials", "client_id": client_id, "client_secret": client_secret}
                if scope:
                    form["scope"] = scope
                r = await http.post("/api/identity/auth/token", data=form)
                if r.status_code >= 400:
                    raise ApiError(r.status_code, _problem(r))
                return str(r.json()["access_token"])

        self.token = None
        self.token_provider = provider

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

    # --- app runtime: users ---

    async def bind_controller(
        self, project_id: uuid.UUID | str, app_slug: str, service_account_id: uuid.UUID | str
    ) -> dict[str, Any]:
        """Make a service account (scope `app-controller`) the controller of `app_slug` in the project."""
        return await self.request(
            "PUT",
            f"{self.ar}/projects/{project_id}/controllers/{app_slug}",
            json={"service_account_id": str(service_account_id)},
        )

    async def deploy(
        self,
        project_id: uuid.UUID | str,
        *,
        name: str,
        app_slug: str,
        placement: PlacementIntent | dict[str, Any],
        config: dict[str, Any] | None = None,
        app_version: str | None = None,
        idempotency_key: str | None = None,
    ) -> Instance:
        body = {
            "name": name,
            "app_slug": app_slug,
            "app_version": app_version,
            "config": config or {},
            "placement_intent": placement.model_dump(mode="json")
            if isinstance(placement, PlacementIntent)
            else placement,
        }
        data = await self.request(
            "POST", f"{self.ar}/projects/{project_id}/instances", json=body, idempotency_key=idempotency_key
        )
        return Instance.model_validate(data)

    async def instance(self, instance_id: uuid.UUID | str) -> Instance:
        return Instance.model_validate(await self.request("GET", f"{self.ar}/instances/{instance_id}"))

    async def instances(self, **params: Any) -> list[Instance]:
        data = await self.request("GET", f"{self.ar}/instances", params=_params(params))
        return [Instance.model_validate(i) for i in data["items"]]

    async def members(self, instance_id: uuid.UUID | str, *, include_tombstones: bool = False) -> list[Member]:
        data = await self.request(
            "GET",
            f"{self.ar}/instances/{instance_id}/members",
            params={"include_tombstones": str(include_tombstones).lower()},
        )
        return [Member.model_validate(m) for m in data["items"]]

    async def operations(self, instance_id: uuid.UUID | str) -> list[Operation]:
        data = await self.request("GET", f"{self.ar}/instances/{instance_id}/operations")
        return [Operation.model_validate(o) for o in data["items"]]

    async def request_operation(
        self,
        instance_id: uuid.UUID | str,
        kind: str,
        *,
        member_id: uuid.UUID | str | None = None,
        allocation_id: uuid.UUID | str | None = None,
        component_key: str | None = None,
        params: dict[str, Any] | None = None,
        as_controller: bool = False,
    ) -> Operation:
        body = {
            "kind": kind,
            "member_id": _s(member_id),
            "allocation_id": _s(allocation_id),
            "component_key": component_key,
            "params": params or {},
        }
        base = f"{self.ar}/controller/instances" if as_controller else f"{self.ar}/instances"
        return Operation.model_validate(await self.request("POST", f"{base}/{instance_id}/operations", json=body))

    async def timeline(self, instance_id: uuid.UUID | str, *, after: int = 0) -> list[TimelineEntry]:
        data = await self.request("GET", f"{self.ar}/instances/{instance_id}/events", params={"after": after})
        return [TimelineEntry.model_validate(e) for e in data["items"]]

    async def stream_timeline(self, instance_id: uuid.UUID | str, *, after: int = 0) -> AsyncIterator[TimelineEntry]:
        """Server-sent timeline entries as they happen (through the gateway's SSE passthrough)."""
        headers = {"Accept": "text/event-stream"}
        if self.token is None and self.token_provider is not None:
            self.token = await self.token_provider()
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        async with self._http.stream(
            "GET",
            f"{self.ar}/instances/{instance_id}/events/stream",
            params={"after": after},
            headers=headers,
            timeout=httpx.Timeout(10.0, read=None),
        ) as response:
            if response.status_code >= 400:
                await response.aread()
                raise ApiError(response.status_code, _problem(response))
            data: list[str] = []
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    data.append(line[5:].strip())
                elif line == "" and data:
                    yield TimelineEntry.model_validate(json.loads("\n".join(data)))
                    data = []

    async def stop_instance(self, instance_id: uuid.UUID | str) -> Instance:
        return Instance.model_validate(await self.request("POST", f"{self.ar}/instances/{instance_id}/stop"))

    async def start_instance(self, instance_id: uuid.UUID | str) -> Instance:
        return Instance.model_validate(await self.request("POST", f"{self.ar}/instances/{instance_id}/start"))

    async def decommission(self, instance_id: uuid.UUID | str, reason: str = "") -> Instance:
        return Instance.model_validate(
            await self.request("POST", f"{self.ar}/instances/{instance_id}/decommission", json={"reason": reason})
        )

    async def force_decommission(self, instance_id: uuid.UUID | str, reason: str) -> Instance:
        return Instance.model_validate(
            await self.request("POST", f"{self.ar}/instances/{instance_id}/decommission/force", json={"reason": reason})
        )

    async def upgrade(self, instance_id: uuid.UUID | str, app_version: str) -> Instance:
        return Instance.model_validate(
            await self.request("POST", f"{self.ar}/instances/{instance_id}/upgrade", json={"app_version": app_version})
        )

    async def rollback(self, instance_id: uuid.UUID | str) -> Instance:
        return Instance.model_validate(await self.request("POST", f"{self.ar}/instances/{instance_id}/rollback"))

    async def credential(self, instance_id: uuid.UUID | str) -> Credential:
        """The public half of the instance's access credential."""
        return Credential.model_validate(await self.request("GET", f"{self.ar}/instances/{instance_id}/credential"))

    async def rotate_credential(self, instance_id: uuid.UUID | str) -> Credential:
        return Credential.model_validate(
            await self.request("POST", f"{self.ar}/instances/{instance_id}/credential/rotate")
        )

    async def retry_operation(self, operation_id: uuid.UUID | str, reason: str = "") -> Operation:
        return Operation.model_validate(
            await self.request("POST", f"{self.ar}/operations/{operation_id}/retry", json={"reason": reason})
        )

    async def cancel_operation(self, operation_id: uuid.UUID | str, reason: str = "") -> Operation:
        return Operation.model_validate(
            await self.request("POST", f"{self.ar}/operations/{operation_id}/cancel", json={"reason": reason})
        )

    async def force_fail_operation(self, operation_id: uuid.UUID | str, reason: str) -> Operation:
        return Operation.model_validate(
            await self.request("POST", f"{self.ar}/operations/{operation_id}/force-fail", json={"reason": reason})
        )

    # --- app runtime: controllers (project service account, scope app-controller) ---

    async def desired_instances(self, app_slug: str) -> list[Instance]:
        data = await self.request("GET", f"{self.ar}/controller/instances", params={"app_slug": app_slug})
        return [Instance.model_validate(i) for i in data["items"]]

    async def controller_members(self, instance_id: uuid.UUID | str) -> list[Member]:
        data = await self.request("GET", f"{self.ar}/controller/instances/{instance_id}/members")
        return [Member.model_validate(m) for m in data["items"]]

    async def pending_operations(self, app_slug: str, *statuses: str) -> list[Operation]:
        params: list[tuple[str, str]] = [("app_slug", app_slug), *(("status", s) for s in statuses or ("pending",))]
        data = await self.request("GET", f"{self.ar}/controller/operations", params=params)
        return [Operation.model_validate(o) for o in data["items"]]

    async def claim(
        self,
        app_slug: str,
        *,
        operation_id: uuid.UUID | str | None = None,
        lease_s: int | None = None,
        holder: str | None = None,
    ) -> Claim | None:
        """Claim the oldest claimable operation (or a given one); None when there is nothing to do."""
        data = await self.request(
            "POST",
            f"{self.ar}/controller/operations/claim",
            json={"app_slug": app_slug, "operation_id": _s(operation_id), "lease_s": lease_s, "holder": holder},
        )
        return Claim.model_validate(data) if data else None

    async def heartbeat(
        self,
        operation_id: uuid.UUID | str,
        lease_token: uuid.UUID | str,
        *,
        message: str | None = None,
        percent: int | None = None,
        lease_s: int | None = None,
    ) -> Operation:
        body = {"lease_token": str(lease_token), "message": message, "percent": percent, "lease_s": lease_s}
        return Operation.model_validate(
            await self.request("POST", f"{self.ar}/controller/operations/{operation_id}/heartbeat", json=body)
        )

    async def complete(
        self,
        operation_id: uuid.UUID | str,
        lease_token: uuid.UUID | str,
        *,
        result: dict[str, Any] | None = None,
        member_detail: dict[str, Any] | None = None,
    ) -> Operation:
        body = {"lease_token": str(lease_token), "result": result or {}, "member_detail": member_detail}
        return Operation.model_validate(
            await self.request("POST", f"{self.ar}/controller/operations/{operation_id}/complete", json=body)
        )

    async def fail(self, operation_id: uuid.UUID | str, lease_token: uuid.UUID | str, error: str) -> Operation:
        return Operation.model_validate(
            await self.request(
                "POST",
                f"{self.ar}/controller/operations/{operation_id}/fail",
                json={"lease_token": str(lease_token), "error": error},
            )
        )

    async def report_instance(
        self,
        instance_id: uuid.UUID | str,
        *,
        status: str | None = None,
        health: dict[str, Any] | None = None,
        runtime_detail: dict[str, Any] | None = None,
        app_version: str | None = None,
    ) -> Instance:
        body = {"status": status, "health": health, "runtime_detail": runtime_detail, "app_version": app_version}
        return Instance.model_validate(
            await self.request("PUT", f"{self.ar}/controller/instances/{instance_id}/status", json=body)
        )

    async def report_member(
        self, member_id: uuid.UUID | str, *, status: str | None = None, detail: dict[str, Any] | None = None
    ) -> Member:
        return Member.model_validate(
            await self.request(
                "PUT", f"{self.ar}/controller/members/{member_id}/status", json={"status": status, "detail": detail}
            )
        )

    async def report_event(
        self, instance_id: uuid.UUID | str, kind: str, message: str = "", **data: Any
    ) -> TimelineEntry:
        return TimelineEntry.model_validate(
            await self.request(
                "POST",
                f"{self.ar}/controller/instances/{instance_id}/events",
                json={"kind": kind, "message": message, "data": data},
            )
        )

    async def fetch_credential(self, instance_id: uuid.UUID | str) -> CredentialSecret:
        """The instance's SSH key pair (controller only). Keep the private key in memory; never log it."""
        return CredentialSecret.model_validate(
            await self.request("GET", f"{self.ar}/controller/instances/{instance_id}/credential")
        )


def _s(value: Any) -> str | None:
    return None if value is None else str(value)


def _params(params: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in params.items() if v is not None}


def _problem(response: httpx.Response) -> dict[str, Any]:
    try:
        return response.json()
    except ValueError:
        return {"code": "http_error", "detail": response.text[:500]}
