"""App-runtime events through the real broker: access grants become SSH grants on member
allocations (and go away when revoked); a release waits for app-runtime's clearance."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from gpuaas.contracts import Event, new_event_id
from gpuaas.contracts.events import app_runtime as app_runtime_events
from gpuaas.kit.kafka import make_producer
from gpuaas.kit.testing import wait_for
from gpuaas.kit.testing_events import signed_payload

from .conftest import World, last_seq, ssh_key, ssh_refused, ssh_run, task_done

pytestmark = pytest.mark.integration


async def publish(bootstrap: str, *events: Event) -> None:
    producer = make_producer(bootstrap, 1_000_000)
    await producer.start()
    try:
        for e in events:
            await producer.send_and_wait(e.topic, signed_payload(e), key=e.key())  # as its producer's relay signs
    finally:
        await producer.stop()


async def test_access_grant_and_release_clearance(world: World, infra) -> None:
    w = world
    await wait_for(lambda: w.kit.consumer is not None and w.kit.consumer.assigned, 60, "consumer assignment")
    await w.host_with_agent("gpu-1", "8xH100-80GB")
    aid = (await w.create("owner")).json()["allocation_id"]
    alloc = await w.wait_status("owner", aid, "active")
    ctl_key, ctl_pub = ssh_key()
    grant = app_runtime_events.AccessGrantState(
        access_grant_id=uuid.uuid4(),
        instance_id=uuid.uuid4(),
        tenant_id=w.ids["t1"],
        project_id=w.ids["p1"],
        allocation_ids=[uuid.UUID(aid)],
        public_key=ctl_pub,
        fingerprint="SHA256:x",
        version=1,
    )
    member = app_runtime_events.MemberState(
        member_id=uuid.uuid4(),
        instance_id=grant.instance_id,
        tenant_id=w.ids["t1"],
        project_id=w.ids["p1"],
        component_key="worker",
        allocation_id=uuid.UUID(aid),
        status=app_runtime_events.MemberStatus.active,
        status_changed_at=datetime.now(UTC),
        version=1,
    )
    async with w.client("owner") as c:
        seen = await last_seq(c, aid)
    await publish(
        infra.kafka_bootstrap,
        app_runtime_events.AccessGrantRequested.build(data=grant, source="app-runtime"),
        app_runtime_events.MemberAdded.build(data=member, source="app-runtime"),
    )
    async with w.client("owner") as c:
        # The progress signal: the agent reported the key sync the consumed grant queued.
        await task_done(c, aid, "sync_ssh_keys", seen, timeout_s=30)
        assert (await ssh_run(alloc, ctl_key, "echo ctl")).stdout.strip() == "ctl"
        grants = (await c.get(f"/allocations/{aid}/ssh-grants")).json()
        assert [g["origin"] for g in grants] == ["app_access_grant"]
        r = await c.delete(f"/allocations/{aid}/ssh-grants/{grants[0]['grant_id']}")
        assert r.status_code == 409 and r.json()["code"] == "ssh_grant_managed"
        seen = await last_seq(c, aid)

    revoked = grant.model_copy(update={"status": "revoked", "version": 2})
    await publish(
        infra.kafka_bootstrap, app_runtime_events.AccessGrantRevoked.build(data=revoked, source="app-runtime")
    )

    async with w.client("owner") as c:
        await task_done(c, aid, "sync_ssh_keys", seen, timeout_s=30)
    assert await ssh_refused(alloc, ctl_key)

    # The member is live: the release waits for app-runtime to stop it.
    async with w.client("owner") as c:
        r = await c.post(f"/allocations/{aid}/release")
        assert r.status_code == 202 and r.json()["awaiting_release_clearance"] is True
        assert r.json()["billing_stopped_at"]
    clearance = app_runtime_events.ReleaseClearance(
        allocation_id=uuid.UUID(aid),
        tenant_id=w.ids["t1"],
        project_id=w.ids["p1"],
        stopped_member_ids=[member.member_id],
        cleared_at=datetime.now(UTC),
    )
    assert (await w.wait_status("owner", aid, "releasing"))["awaiting_release_clearance"] is True
    await publish(
        infra.kafka_bootstrap,
        app_runtime_events.ReleaseClearanceGranted.build(data=clearance, source="app-runtime", id=new_event_id()),
    )
    await w.wait_status("owner", aid, "released", timeout_s=30)
    async with w.client("owner") as c:
        timeline = (await c.get(f"/allocations/{aid}/timeline")).json()
        assert any(e["phase"] == "release.clearance" and e["status"] == "succeeded" for e in timeline)
