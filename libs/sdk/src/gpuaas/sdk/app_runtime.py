"""App runtime: app instances, their members and operations, timelines and credentials; and the controller
side (claim → heartbeat → complete/fail, reports) that `gpuaas.sdk.controller` drives. Paths start at
`self.ar` (the gateway's `/api/app-runtime`, or an in-process app's own root in tests)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from pydantic import BaseModel

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
from gpuaas.sdk.transport import ApiError, Id, Transport, problem_of, query, s


class AppRuntimeApi(Transport):
    # --- users ---

    async def bind_controller(self, project_id: Id, app_slug: str, service_account_id: Id) -> dict[str, Any]:
        """Make a service account (scope `app-controller`) the controller of `app_slug` in the project."""
        return await self.request(
            "PUT",
            f"{self.ar}/projects/{project_id}/controllers/{app_slug}",
            json={"service_account_id": str(service_account_id)},
        )

    async def deploy(
        self,
        project_id: Id,
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
            "placement_intent": placement.model_dump(mode="json") if isinstance(placement, BaseModel) else placement,
        }
        data = await self.request(
            "POST", f"{self.ar}/projects/{project_id}/instances", json=body, idempotency_key=idempotency_key
        )
        return Instance.model_validate(data)

    async def instance(self, instance_id: Id) -> Instance:
        return Instance.model_validate(await self.request("GET", f"{self.ar}/instances/{instance_id}"))

    async def instances(self, **params: Any) -> list[Instance]:
        data = await self.request("GET", f"{self.ar}/instances", params=query(params))
        return [Instance.model_validate(i) for i in data["items"]]

    async def members(self, instance_id: Id, *, include_tombstones: bool = False) -> list[Member]:
        data = await self.request(
            "GET",
            f"{self.ar}/instances/{instance_id}/members",
            params={"include_tombstones": str(include_tombstones).lower()},
        )
        return [Member.model_validate(m) for m in data["items"]]

    async def operations(self, instance_id: Id) -> list[Operation]:
        data = await self.request("GET", f"{self.ar}/instances/{instance_id}/operations")
        return [Operation.model_validate(o) for o in data["items"]]

    async def request_operation(
        self,
        instance_id: Id,
        kind: str,
        *,
        member_id: Id | None = None,
        allocation_id: Id | None = None,
        component_key: str | None = None,
        params: dict[str, Any] | None = None,
        as_controller: bool = False,
        idempotency_key: str | None = None,
    ) -> Operation:
        body = {
            "kind": kind,
            "member_id": s(member_id),
            "allocation_id": s(allocation_id),
            "component_key": component_key,
            "params": params or {},
        }
        base = f"{self.ar}/controller/instances" if as_controller else f"{self.ar}/instances"
        data = await self.request(
            "POST", f"{base}/{instance_id}/operations", json=body, idempotency_key=idempotency_key
        )
        return Operation.model_validate(data)

    async def timeline(self, instance_id: Id, *, after: int = 0) -> list[TimelineEntry]:
        data = await self.request("GET", f"{self.ar}/instances/{instance_id}/events", params={"after": after})
        return [TimelineEntry.model_validate(e) for e in data["items"]]

    async def stream_timeline(self, instance_id: Id, *, after: int = 0) -> AsyncIterator[TimelineEntry]:
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
                raise ApiError(response.status_code, problem_of(response))
            data: list[str] = []
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    data.append(line[5:].strip())
                elif line == "" and data:
                    yield TimelineEntry.model_validate(json.loads("\n".join(data)))
                    data = []

    async def stop_instance(self, instance_id: Id) -> Instance:
        return Instance.model_validate(await self.request("POST", f"{self.ar}/instances/{instance_id}/stop"))

    async def start_instance(self, instance_id: Id) -> Instance:
        return Instance.model_validate(await self.request("POST", f"{self.ar}/instances/{instance_id}/start"))

    async def decommission(self, instance_id: Id, reason: str = "", *, idempotency_key: str | None = None) -> Instance:
        data = await self.request(
            "POST",
            f"{self.ar}/instances/{instance_id}/decommission",
            json={"reason": reason},
            idempotency_key=idempotency_key,
        )
        return Instance.model_validate(data)

    async def force_decommission(self, instance_id: Id, reason: str) -> Instance:
        return Instance.model_validate(
            await self.request("POST", f"{self.ar}/instances/{instance_id}/decommission/force", json={"reason": reason})
        )

    async def upgrade(self, instance_id: Id, app_version: str) -> Instance:
        return Instance.model_validate(
            await self.request("POST", f"{self.ar}/instances/{instance_id}/upgrade", json={"app_version": app_version})
        )

    async def rollback(self, instance_id: Id) -> Instance:
        return Instance.model_validate(await self.request("POST", f"{self.ar}/instances/{instance_id}/rollback"))

    async def credential(self, instance_id: Id) -> Credential:
        """The public half of the instance's access credential."""
        return Credential.model_validate(await self.request("GET", f"{self.ar}/instances/{instance_id}/credential"))

    async def rotate_credential(self, instance_id: Id) -> Credential:
        return Credential.model_validate(
            await self.request("POST", f"{self.ar}/instances/{instance_id}/credential/rotate")
        )

    async def retry_operation(self, operation_id: Id, reason: str = "") -> Operation:
        return Operation.model_validate(
            await self.request("POST", f"{self.ar}/operations/{operation_id}/retry", json={"reason": reason})
        )

    async def cancel_operation(self, operation_id: Id, reason: str = "") -> Operation:
        return Operation.model_validate(
            await self.request("POST", f"{self.ar}/operations/{operation_id}/cancel", json={"reason": reason})
        )

    async def force_fail_operation(self, operation_id: Id, reason: str) -> Operation:
        return Operation.model_validate(
            await self.request("POST", f"{self.ar}/operations/{operation_id}/force-fail", json={"reason": reason})
        )

    # --- controllers (project service account, scope app-controller) ---

    async def desired_instances(self, app_slug: str) -> list[Instance]:
        data = await self.request("GET", f"{self.ar}/controller/instances", params={"app_slug": app_slug})
        return [Instance.model_validate(i) for i in data["items"]]

    async def controller_members(self, instance_id: Id) -> list[Member]:
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
        operation_id: Id | None = None,
        lease_s: int | None = None,
        holder: str | None = None,
    ) -> Claim | None:
        """Claim the oldest claimable operation (or a given one); None when there is nothing to do."""
        data = await self.request(
            "POST",
            f"{self.ar}/controller/operations/claim",
            json={"app_slug": app_slug, "operation_id": s(operation_id), "lease_s": lease_s, "holder": holder},
        )
        return Claim.model_validate(data) if data else None

    async def heartbeat(
        self,
        operation_id: Id,
        lease_token: Id,
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
        operation_id: Id,
        lease_token: Id,
        *,
        result: dict[str, Any] | None = None,
        member_detail: dict[str, Any] | None = None,
    ) -> Operation:
        body = {"lease_token": str(lease_token), "result": result or {}, "member_detail": member_detail}
        return Operation.model_validate(
            await self.request("POST", f"{self.ar}/controller/operations/{operation_id}/complete", json=body)
        )

    async def defer(
        self, operation_id: Id, lease_token: Id, *, reason: str = "", delay_s: float | None = None
    ) -> Operation:
        """Give a claimed operation back without it counting as an attempt (see `controller.Defer`)."""
        body = {
            "lease_token": str(lease_token),
            "reason": reason,
            "delay_s": None if delay_s is None else max(0, round(delay_s)),
        }
        return Operation.model_validate(
            await self.request("POST", f"{self.ar}/controller/operations/{operation_id}/defer", json=body)
        )

    async def fail(self, operation_id: Id, lease_token: Id, error: str) -> Operation:
        return Operation.model_validate(
            await self.request(
                "POST",
                f"{self.ar}/controller/operations/{operation_id}/fail",
                json={"lease_token": str(lease_token), "error": error},
            )
        )

    async def report_instance(
        self,
        instance_id: Id,
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
        self, member_id: Id, *, status: str | None = None, detail: dict[str, Any] | None = None
    ) -> Member:
        return Member.model_validate(
            await self.request(
                "PUT", f"{self.ar}/controller/members/{member_id}/status", json={"status": status, "detail": detail}
            )
        )

    async def report_event(self, instance_id: Id, kind: str, message: str = "", **data: Any) -> TimelineEntry:
        return TimelineEntry.model_validate(
            await self.request(
                "POST",
                f"{self.ar}/controller/instances/{instance_id}/events",
                json={"kind": kind, "message": message, "data": data},
            )
        )

    async def fetch_credential(self, instance_id: Id) -> CredentialSecret:
        """The instance's SSH key pair (controller only). Keep the private key in memory; never log it."""
        return CredentialSecret.model_validate(
            await self.request("GET", f"{self.ar}/controller/instances/{instance_id}/credential")
        )

    async def controller_state(self, instance_id: Id) -> dict[str, Any]:
        """`{"state": {...}, "version": n}` (version 0: nothing stored yet); see `gpuaas.sdk.controller.state`."""
        data: dict[str, Any] = await self.request("GET", f"{self.ar}/controller/instances/{instance_id}/state")
        return data

    async def put_controller_state(
        self, instance_id: Id, state: dict[str, Any], expected_version: int
    ) -> dict[str, Any]:
        """Compare-and-set: raises `ApiError` 409 `state_version_conflict` when another write came first."""
        data: dict[str, Any] = await self.request(
            "PUT",
            f"{self.ar}/controller/instances/{instance_id}/state",
            json={"state": state, "expected_version": expected_version},
        )
        return data
