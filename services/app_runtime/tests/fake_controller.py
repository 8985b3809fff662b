"""A test app controller built only on the public SDK (what an outside team would write).

It keeps a fake "cluster" in memory; knobs make a worker fail bootstrap, a teardown unverifiable, or
the controller hang mid-operation (to be killed)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncssh

from gpuaas.sdk import Client, Controller, OperationContext, OperationFailed, ReconcileLoop
from gpuaas.sdk.models import Instance


class FakeSlurm(Controller):
    def __init__(self) -> None:
        self.fail_bootstrap: set[uuid.UUID] = set()  # allocations whose next bootstrap fails
        self.unverified: set[uuid.UUID] = set()  # allocations whose teardown cannot be verified
        self.hang_on: set[uuid.UUID] = set()  # allocations where add/recover hangs forever
        self.nodes: dict[uuid.UUID, dict[str, Any]] = {}  # member id -> node
        self.fingerprints: set[str] = set()
        self.rollouts: list[tuple[uuid.UUID, str]] = []

    async def _check_key(self, ctx: OperationContext) -> None:
        cred = await ctx.credential()
        key = asyncssh.import_private_key(cred.private_key)
        assert key.export_public_key("openssh").decode().strip() == cred.public_key
        self.fingerprints.add(cred.fingerprint)

    async def add(self, ctx: OperationContext) -> dict[str, Any]:
        op = ctx.operation
        await self._check_key(ctx)
        await ctx.progress(f"installing {op.component_key} on {op.allocation_id}", 30)
        if op.allocation_id in self.hang_on:
            await asyncio.Event().wait()
        if op.allocation_id in self.fail_bootstrap:
            self.fail_bootstrap.discard(op.allocation_id)
            raise OperationFailed("slurmd bootstrap failed: munge key mismatch")
        member = op.target_member_id
        assert member is not None
        self.nodes[member] = {"allocation": op.allocation_id, "role": op.component_key}
        await ctx.event("node_joined", f"{op.component_key} joined", member_id=str(member))
        return {"node": f"node-{str(member)[-6:]}"}

    recover = add
    replace = add

    async def drain(self, ctx: OperationContext) -> dict[str, Any]:
        return {"drained": True}

    async def remove(self, ctx: OperationContext) -> dict[str, Any]:
        op = ctx.operation
        await ctx.progress("stopping daemons", 50)
        self.nodes.pop(op.member_id, None)
        if op.allocation_id in self.unverified:
            return {"teardown_verified": False, "evidence": "host unreachable: could not confirm slurmd stopped"}
        return {"teardown_verified": True, "evidence": "slurmd stopped; state dir wiped; node deregistered"}

    async def reconcile(self, client: Client, instance: Instance) -> None:
        if instance.desired_app_version:
            self.rollouts.append((instance.instance_id, instance.desired_app_version))
            await client.report_instance(
                instance.instance_id,
                app_version=instance.desired_app_version,
                runtime_detail={"slurm_version": instance.desired_app_version},
            )


async def drive(loop: ReconcileLoop, until: Callable[[], Awaitable[bool]], timeout_s: float = 30) -> None:
    """Run the loop until `until()` holds (checked between rounds)."""
    task = asyncio.create_task(loop.run())
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await until():
            if task.done():
                task.result()
            if asyncio.get_running_loop().time() > deadline:
                handled = [(o.kind, o.status, o.error) for o in loop.handled]
                raise AssertionError(f"controller did not converge in time; it reported {handled}")
            await asyncio.sleep(0.1)
    finally:
        loop.stop()
        await asyncio.wait_for(task, 10)
