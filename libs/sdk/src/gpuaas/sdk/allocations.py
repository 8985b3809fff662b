"""Allocations: hosts (operators), allocations and their timeline, SSH keys and grants, volumes, capacity queues."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuaas.sdk.models import (
    Allocation,
    AllocationTimelineEntry,
    CapacityQueue,
    QueueHistory,
    RuntimeOption,
    SshGrant,
    SshHostKey,
    SshKey,
    Volume,
)
from gpuaas.sdk.transport import Id, Transport, s

ALLOCATIONS = "/api/allocations"


class AllocationsApi(Transport):
    async def enrol_host(self, name: str, gpus: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return await self.request("POST", f"{ALLOCATIONS}/hosts", json={"name": name, "gpus": gpus, **fields})

    # --- allocations ---

    async def runtimes(self, project_id: Id | None = None) -> list[RuntimeOption]:
        """Runtime images a new allocation may name in `runtime` (newest version first per slug); with
        `project_id`, also the canaries offered to the project's tenant."""
        params = None if project_id is None else {"project_id": s(project_id)}
        data = await self.request("GET", f"{ALLOCATIONS}/runtimes", params=params)
        return [RuntimeOption.model_validate(r) for r in data]

    async def create_allocation(
        self,
        project_id: Id,
        *,
        gpu_model: str,
        name: str = "",
        shape: str = "gpu_slice",
        gpu_count: int | None = None,
        host_class: str | None = None,
        volume_ids: Sequence[Id] = (),
        runtime: str | None = None,
        idempotency_key: str | None = None,
        queue: bool = True,
        priority: int = 0,
        max_wait: int | None = None,
    ) -> Allocation:
        """`runtime`: the runtime image, as "slug" (its newest active version), "slug@version" or
        "sha256:<hex>" (an active runtime's digest); None lets the host class / platform default apply.
        `queue`: wait `queued` (pending_reason, queue_position) when it cannot be placed now, else 409;
        `priority` (-100..100) orders it in its project's queue; `max_wait`: seconds before a queued one fails."""
        body: dict[str, Any] = {
            "name": name,
            "shape": shape,
            "gpu_model": gpu_model,
            "gpu_count": gpu_count,
            "host_class": host_class,
            "volume_ids": [str(v) for v in volume_ids],
        }
        if runtime is not None:  # only when chosen: the body stays what older platforms accept
            body["runtime"] = runtime
        if not queue:
            body["queue"] = False
        if priority:
            body["priority"] = priority
        if max_wait is not None:
            body["max_wait"] = max_wait
        data = await self.request(
            "POST", f"{ALLOCATIONS}/projects/{project_id}/allocations", json=body, idempotency_key=idempotency_key
        )
        return Allocation.model_validate(data)

    async def queues(self, gpu_model: str | None = None) -> list[CapacityQueue]:
        """Every capacity queue of each pool (operators): usage against guarantee, limit and weight."""
        params = None if gpu_model is None else {"gpu_model": gpu_model}
        return [
            CapacityQueue.model_validate(q) for q in await self.request("GET", f"{ALLOCATIONS}/queues", params=params)
        ]

    async def tenant_queues(self, tenant_id: Id, gpu_model: str | None = None) -> list[CapacityQueue]:
        """The tenant's queue and its projects' queues of each pool (tenant admins and operators)."""
        params = None if gpu_model is None else {"gpu_model": gpu_model}
        data = await self.request("GET", f"{ALLOCATIONS}/tenants/{tenant_id}/queues", params=params)
        return [CapacityQueue.model_validate(q) for q in data]

    async def queue_history(
        self,
        tenant_id: Id | None = None,
        *,
        gpu_model: str | None = None,
        since: str | None = None,
        until: str | None = None,
        points: int = 25,
    ) -> QueueHistory:
        """Each queue's share (GPUs held) at `points` instants from `since` to `until` (ISO 8601 with a time zone;
        default the last 24 h): every tenant's queue (operators), or with `tenant_id` the tenant's and its
        projects' queues (tenant admins)."""
        params: dict[str, Any] = {"points": points}
        params.update({k: v for k, v in (("gpu_model", gpu_model), ("since", since), ("until", until)) if v})
        path = "/queue-history" if tenant_id is None else f"/tenants/{tenant_id}/queue-history"
        return QueueHistory.model_validate(await self.request("GET", f"{ALLOCATIONS}{path}", params=params))

    async def project_queue(self, project_id: Id, gpu_model: str) -> CapacityQueue:
        data = await self.request("GET", f"{ALLOCATIONS}/projects/{project_id}/queues/{gpu_model}")
        return CapacityQueue.model_validate(data)

    async def set_queue(
        self,
        scope: str,
        scope_id: Id,
        gpu_model: str,
        *,
        guarantee: int = 0,
        limit: int | None = None,
        lend_limit: int | None = None,
        weight: float = 1.0,
    ) -> CapacityQueue:
        """Set a tenant's (`scope="tenant"`, operators) or a project's (`scope="project"`, tenant admins) queue."""
        body = {"guarantee": guarantee, "limit": limit, "lend_limit": lend_limit, "weight": weight}
        data = await self.request("PUT", f"{ALLOCATIONS}/{scope}s/{scope_id}/queues/{gpu_model}", json=body)
        return CapacityQueue.model_validate(data)

    async def allocations(self, project_id: Id, *, include_released: bool = False) -> list[Allocation]:
        data = await self.request(
            "GET", f"{ALLOCATIONS}/projects/{project_id}/allocations", params={"include_released": include_released}
        )
        return [Allocation.model_validate(a) for a in data]

    async def allocation(self, allocation_id: Id) -> Allocation:
        return Allocation.model_validate(await self.request("GET", f"{ALLOCATIONS}/allocations/{allocation_id}"))

    async def ssh_host_key(self, allocation_id: Id) -> SshHostKey:
        """The allocation's SSH endpoint and the host key pinned for it (verify the host with `known_hosts`)."""
        path = f"{ALLOCATIONS}/allocations/{allocation_id}/ssh-host-key"
        return SshHostKey.model_validate(await self.request("GET", path))

    async def allocation_timeline(
        self, allocation_id: Id, *, after: int | None = None
    ) -> list[AllocationTimelineEntry]:
        """The phases of the allocation's changes (those after sequence number `after`, when given)."""
        params = None if after is None else {"after": after}
        data = await self.request("GET", f"{ALLOCATIONS}/allocations/{allocation_id}/timeline", params=params)
        return [AllocationTimelineEntry.model_validate(e) for e in data]

    async def _allocation_action(
        self, allocation_id: Id, action: str, body: dict[str, Any], idempotency_key: str | None
    ) -> Allocation:
        data = await self.request(
            "POST", f"{ALLOCATIONS}/allocations/{allocation_id}/{action}", json=body, idempotency_key=idempotency_key
        )
        return Allocation.model_validate(data)

    async def restart_allocation(self, allocation_id: Id, *, idempotency_key: str | None = None) -> Allocation:
        """In place: same id, host, endpoint, keys and volumes."""
        return await self._allocation_action(allocation_id, "restart", {}, idempotency_key)

    async def resize_allocation(
        self, allocation_id: Id, gpu_count: int, *, queue: bool = True, idempotency_key: str | None = None
    ) -> Allocation:
        """A resize up its host cannot give now waits (`pending_resize_gpus`) unless `queue=False` (then 409)."""
        body: dict[str, Any] = {"gpu_count": gpu_count}
        if not queue:  # sent only when chosen: the body older platforms accept
            body["queue"] = False
        return await self._allocation_action(allocation_id, "resize", body, idempotency_key)

    async def cancel_resize(self, allocation_id: Id, *, idempotency_key: str | None = None) -> Allocation:
        """Cancel a resize that waits for GPUs (409 `no_pending_resize` when none waits)."""
        data = await self.request(
            "DELETE", f"{ALLOCATIONS}/allocations/{allocation_id}/resize", idempotency_key=idempotency_key
        )
        return Allocation.model_validate(data)

    async def release_allocation(self, allocation_id: Id, *, idempotency_key: str | None = None) -> Allocation:
        return await self._allocation_action(allocation_id, "release", {}, idempotency_key)

    async def retry_release_allocation(self, allocation_id: Id, *, idempotency_key: str | None = None) -> Allocation:
        return await self._allocation_action(allocation_id, "retry-release", {}, idempotency_key)

    # --- SSH keys and grants ---

    async def ssh_keys(self) -> list[SshKey]:
        """The signed-in user's personal keys."""
        return [SshKey.model_validate(k) for k in await self.request("GET", f"{ALLOCATIONS}/ssh-keys")]

    async def add_ssh_key(self, name: str, public_key: str, *, idempotency_key: str | None = None) -> SshKey:
        body = {"name": name, "public_key": public_key}
        data = await self.request("POST", f"{ALLOCATIONS}/ssh-keys", json=body, idempotency_key=idempotency_key)
        return SshKey.model_validate(data)

    async def delete_ssh_key(self, key_id: Id) -> None:
        await self.request("DELETE", f"{ALLOCATIONS}/ssh-keys/{key_id}")

    async def ssh_grants(self, allocation_id: Id) -> list[SshGrant]:
        data = await self.request("GET", f"{ALLOCATIONS}/allocations/{allocation_id}/ssh-grants")
        return [SshGrant.model_validate(g) for g in data]

    async def grant_ssh(
        self, allocation_id: Id, user_id: Id, public_key: str, *, idempotency_key: str | None = None
    ) -> SshGrant:
        """Another project member's key on one allocation."""
        body = {"user_id": s(user_id), "public_key": public_key}
        data = await self.request(
            "POST", f"{ALLOCATIONS}/allocations/{allocation_id}/ssh-grants", json=body, idempotency_key=idempotency_key
        )
        return SshGrant.model_validate(data)

    async def revoke_ssh_grant(self, allocation_id: Id, grant_id: Id) -> SshGrant:
        data = await self.request("DELETE", f"{ALLOCATIONS}/allocations/{allocation_id}/ssh-grants/{grant_id}")
        return SshGrant.model_validate(data)

    # --- volumes ---

    async def volumes(self, project_id: Id) -> list[Volume]:
        data = await self.request("GET", f"{ALLOCATIONS}/projects/{project_id}/volumes")
        return [Volume.model_validate(v) for v in data]

    async def create_volume(
        self,
        project_id: Id,
        *,
        name: str,
        size_gb: int,
        persist: bool = True,
        access_mode: str = "single_writer",
        idempotency_key: str | None = None,
    ) -> Volume:
        body = {"name": name, "size_gb": size_gb, "persist": persist, "access_mode": access_mode}
        data = await self.request(
            "POST", f"{ALLOCATIONS}/projects/{project_id}/volumes", json=body, idempotency_key=idempotency_key
        )
        return Volume.model_validate(data)

    async def delete_volume(self, volume_id: Id) -> Volume:
        return Volume.model_validate(await self.request("DELETE", f"{ALLOCATIONS}/volumes/{volume_id}"))
