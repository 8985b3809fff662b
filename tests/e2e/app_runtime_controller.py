"""The e2e test controller: built on the public SDK only, it reaches member allocations over SSH with the
instance's access credential (installed by allocations through the access grant) and keeps a node file
per member there; teardown is verified by checking that file is gone.

Run as a process (so a test can SIGKILL it mid-operation):
    GPUAAS_URL=... GPUAAS_CLIENT_ID=... GPUAAS_CLIENT_SECRET=... APP_SLUG=... HANG_ON=<allocation id> \
        python tests/e2e/app_runtime_controller.py
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import asyncssh

from gpuaas.sdk import Client, Controller, OperationContext, OperationFailed, ReconcileLoop
from gpuaas.sdk.models import Instance


class SshSlurm(Controller):
    def __init__(self) -> None:
        self.fail_bootstrap: set[uuid.UUID] = set()
        self.unverified: set[uuid.UUID] = set()
        self.hang_on: set[uuid.UUID] = set()

    async def _ssh(self, ctx: OperationContext, allocation_id: uuid.UUID, command: str) -> str:
        cred = await ctx.credential()
        key = asyncssh.import_private_key(cred.private_key)
        alloc = await ctx.client.request("GET", f"/api/allocations/allocations/{allocation_id}")
        ep = alloc["ssh_endpoint"]
        for attempt in range(60):  # the grant reaches the host asynchronously (allocations → agent)
            try:
                async with asyncssh.connect(
                    ep["host"],
                    ep["port"],
                    username=ep["username"],
                    client_keys=[key],
                    known_hosts=None,
                    agent_path=None,
                    config=None,
                ) as conn:
                    return (await conn.run(command, check=True, timeout=20)).stdout or ""
            except (asyncssh.PermissionDenied, OSError):
                if attempt % 5 == 0:
                    await ctx.progress(f"waiting for SSH access to {allocation_id}")
                await asyncio.sleep(1)
        raise OperationFailed(f"no SSH access to allocation {allocation_id} with the instance credential")

    async def add(self, ctx: OperationContext) -> dict[str, Any]:
        op = ctx.operation
        assert op.allocation_id is not None and op.target_member_id is not None
        await ctx.progress(f"bootstrapping {op.component_key}", 10)
        if op.allocation_id in self.hang_on:
            await asyncio.Event().wait()
        if op.allocation_id in self.fail_bootstrap:
            self.fail_bootstrap.discard(op.allocation_id)
            raise OperationFailed("slurmd bootstrap failed: munge key mismatch")
        member = op.target_member_id
        out = await self._ssh(
            ctx,
            op.allocation_id,
            f"mkdir -p ~/.slurm-nodes && echo {op.component_key} > ~/.slurm-nodes/{member} && "
            f"cat ~/.slurm-nodes/{member}",
        )
        await ctx.event("node_joined", f"{op.component_key} up on {op.allocation_id}", member_id=str(member))
        return {"node_file": f"~/.slurm-nodes/{member}", "role": out.strip()}

    recover = add
    replace = add

    async def drain(self, ctx: OperationContext) -> dict[str, Any]:
        return {"drained": True}

    async def remove(self, ctx: OperationContext) -> dict[str, Any]:
        op = ctx.operation
        assert op.allocation_id is not None
        if op.allocation_id in self.unverified:
            return {"teardown_verified": False, "evidence": "node file still present: rm refused (test knob)"}
        out = await self._ssh(
            ctx,
            op.allocation_id,
            f"rm -f ~/.slurm-nodes/{op.member_id}; test ! -e ~/.slurm-nodes/{op.member_id} && echo gone",
        )
        verified = out.strip() == "gone"
        return {"teardown_verified": verified, "evidence": f"node file removed and checked: {out.strip()!r}"}

    async def reconcile(self, client: Client, instance: Instance) -> None:
        if instance.desired_app_version:
            await client.report_instance(instance.instance_id, app_version=instance.desired_app_version)


def controller_client(url: str, client_id: str, client_secret: str) -> Client:
    client = Client(url)
    client.use_client_credentials(client_id, client_secret)
    return client


async def _main() -> None:
    client = controller_client(
        os.environ["GPUAAS_URL"], os.environ["GPUAAS_CLIENT_ID"], os.environ["GPUAAS_CLIENT_SECRET"]
    )
    adapter = SshSlurm()
    if os.environ.get("HANG_ON"):
        adapter.hang_on.add(uuid.UUID(os.environ["HANG_ON"]))
    loop = ReconcileLoop(
        client,
        app_slug=os.environ["APP_SLUG"],
        controller=adapter,
        lease_s=int(os.environ.get("LEASE_S", "5")),
        poll_interval_s=0.2,
        holder=os.environ.get("HOLDER"),
    )
    await loop.run()


if __name__ == "__main__":
    asyncio.run(_main())
