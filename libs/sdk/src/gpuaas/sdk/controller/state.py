"""Controller state kept on the platform per instance (Juju ops' `StoredState`, but shared by every replica
and surviving restarts): `GET/PUT /api/app-runtime/controller/instances/{id}/state`, versioned. A write names
the version it read; when another replica wrote first the platform answers 409 `state_version_conflict`
and `update` reads again and re-applies the change (bounded).

    state = await ctx.state()                 # StoredState: .data (dict) and .version
    await state.update(lambda d: d.setdefault("ports", {}).update({"echo": 7000}))
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from gpuaas.sdk.client import ApiError, Client
from gpuaas.sdk.transport import Id


class StateConflict(Exception):
    """The state changed under us on every try."""


class StoredState:
    def __init__(self, client: Client, instance_id: Id, data: dict[str, Any] | None = None, version: int = 0) -> None:
        self.client = client
        self.instance_id = instance_id
        self.data: dict[str, Any] = data or {}
        self.version = version

    @classmethod
    async def load(cls, client: Client, instance_id: Id) -> StoredState:
        got = await client.controller_state(instance_id)
        return cls(client, instance_id, dict(got.get("state") or {}), int(got.get("version") or 0))

    async def refresh(self) -> None:
        got = await self.client.controller_state(self.instance_id)
        self.data, self.version = dict(got.get("state") or {}), int(got.get("version") or 0)

    async def save(self) -> None:
        """Write `data` if nobody wrote since we read it; raises `ApiError` 409 `state_version_conflict` else."""
        got = await self.client.put_controller_state(self.instance_id, self.data, self.version)
        self.version = int(got["version"])

    async def update(self, change: Callable[[dict[str, Any]], Any], *, tries: int = 8) -> dict[str, Any]:
        """Apply `change` (mutates the dict in place) and save; on a conflict re-read and apply again."""
        for attempt in range(tries):
            change(self.data)
            try:
                await self.save()
                return self.data
            except ApiError as exc:
                if exc.code != "state_version_conflict":
                    raise
            await asyncio.sleep(0.05 * (attempt + 1))
            await self.refresh()
        raise StateConflict(f"controller state of {self.instance_id} changed under us {tries} times")
