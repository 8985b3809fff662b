"""App-runtime's reconciler on two replicas (plus the app's own loop, a third) against one Postgres: every operation
whose lease ran out is requeued once (one `member_operation.requeued` event), whichever replica gets it."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from sqlalchemy import text

from gpuaas.app_runtime.reconciler import reconcile_once

from .conftest import World
from .test_runtime import deployed

pytestmark = pytest.mark.integration


async def test_two_replicas_requeue_each_expired_lease_once(rt, world: World) -> None:
    w = world
    await deployed(w, workers=5)
    ctl = w.controller()
    claimed: list[uuid.UUID] = []
    while (claim := await ctl.claim(w.slug, lease_s=300, holder="gone-replica")) is not None:
        claimed.append(uuid.UUID(str(claim.operation.operation_id)))
    assert len(claimed) >= 2, f"the replicas need several expired leases to contend for: {claimed}"
    async with rt.kit.sessions() as s, s.begin():
        # The controller that held them died long ago: every lease ran out at once, so the replicas contend.
        await s.execute(
            text(
                "UPDATE operations SET lease_expires_at = now() - interval '1 minute' "
                "WHERE operation_id = ANY(CAST(:ids AS uuid[]))"
            ),
            {"ids": claimed},
        )

    async def replica() -> None:
        for _ in range(5):
            await reconcile_once(rt.kit)

    await asyncio.gather(replica(), replica())
    async with rt.kit.sessions() as s:
        statuses = (
            await s.execute(
                text("SELECT status FROM operations WHERE operation_id = ANY(CAST(:ids AS uuid[]))"), {"ids": claimed}
            )
        ).all()
    assert [st for (st,) in statuses] == ["pending"] * len(claimed)
    for op_id in claimed:
        requeued = await rt.outbox("member_operation.requeued", op_id)
        assert len(requeued) == 1, f"operation {op_id} requeued {len(requeued)} times"
