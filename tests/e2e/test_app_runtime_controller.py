"""App runtime through the gateway on the real stack: real identity (users, a project service account
with client_credentials), real allocations on a real node-agent, a test controller built on the SDK that
reaches the member allocations over SSH with the instance's access credential.

Catalog's manifest and entitlement are put on its topic through catalog's outbox (the catalog API needs
an OCI registry to register an app; that path is catalog's own e2e).

Covers: deploy, add a worker on a second allocation, remove and re-add it, a worker that fails bootstrap
and is recovered, a controller process SIGKILLed mid-operation whose lease expires and another replica
finishes, the release cascade (members removed before the allocation is released), the SSE timeline,
decommission with verified teardown, and decommission without it (failed, then forced)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncssh
import httpx
import pytest

from gpuaas.contracts.events import catalog as cat
from gpuaas.devstack.golden_path.actors import start_agent
from gpuaas.devstack.infra import stop_process
from gpuaas.devstack.pytest_plugin import target_of
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually
from gpuaas.kit.db import create_engine, session_factory
from gpuaas.kit.outbox import add_events
from gpuaas.sdk import ApiError, Client, ReconcileLoop
from gpuaas.sdk.models import PlacementIntent

from .app_runtime_controller import SshSlurm, controller_client

pytestmark = pytest.mark.e2e
PASSWORD = "correct-horse-battery"


async def publish_as_catalog(stack: Stack, events: list[Any]) -> None:
    engine = create_engine(stack.database_url("catalog"), "catalog", pool_size=1)
    try:
        async with session_factory(engine)() as s, s.begin():
            await add_events(s, events)
    finally:
        await engine.dispose()


async def drive(loop: ReconcileLoop, until: Callable[[], Awaitable[Any]], timeout_s: float = 90) -> None:
    task = asyncio.create_task(loop.run())
    try:
        await eventually(until, timeout_s, "controller to converge", interval_s=0.3)
    finally:
        loop.stop()
        await asyncio.wait_for(task, 30)
        if task.done() and task.exception():
            raise task.exception()


@pytest.fixture
async def world(stack: Stack, gw: httpx.AsyncClient) -> AsyncIterator[dict[str, Any]]:
    run = uuid.uuid4().hex[:6]
    tenant = (await gw.post("/api/identity/tenants", json={"slug": f"hpc-{run}", "name": "HPC"})).json()
    tid = tenant["tenant_id"]
    pid = (await gw.post(f"/api/identity/tenants/{tid}/projects", json={"name": "cluster"})).json()["project_id"]
    email = f"alice-{run}@hpc.example.com"
    r = await gw.post(f"/api/identity/tenants/{tid}/users", json={"email": email, "password": PASSWORD, "role": None})
    assert r.status_code == 201, r.text
    r = await gw.post(
        f"/api/identity/projects/{pid}/members", json={"user_id": r.json()["user_id"], "role": "project_admin"}
    )
    assert r.status_code == 201, r.text
    alice = Client(stack.gateway_url)
    await alice.login(email, PASSWORD)
    r = await gw.post(
        f"/api/identity/projects/{pid}/service-accounts",
        json={"name": f"slurm-ctl-{run}", "scopes": ["app-controller"]},
    )
    assert r.status_code == 201, r.text
    sa = r.json()
    ctl = controller_client(stack.gateway_url, sa["client_id"], sa["client_secret"])

    host = (await gw.post("/api/allocations/hosts", json={"name": f"app-{run}"})).json()
    agent = start_agent(target_of(stack), host["node_token"], f"app-{run}", "8xH100-80GB")
    slug = f"slurm-{run}"
    now = datetime.now(UTC)
    manifest = cat.AppManifestState(
        manifest_id=uuid.uuid4(),
        slug=slug,
        display_name="Slurm",
        version="22.05.1",
        runtime_version="Slurm 22.05",
        artifact_kind=cat.AppArtifactKind.controller,
        artifact_ref="registry.local/apps/slurm@sha256:" + "a" * 64,
        compatibility=cat.Compatibility(multi_allocation=True),
        inputs={"type": "object", "properties": {"partition": {"type": "string"}}, "required": ["partition"]},
        roles=[cat.AppRole(key="slurmctld"), cat.AppRole(key="slurmd")],
        active=True,
        revision=1,
    )
    await publish_as_catalog(
        stack,
        [
            cat.AppRegistered.build(data=manifest, source="catalog"),
            cat.EntitlementGranted.build(
                source="catalog",
                data=cat.EntitlementState(
                    entitlement_id=uuid.uuid4(), tenant_id=uuid.UUID(tid), app_slug=slug, granted_at=now, version=1
                ),
            ),
        ],
    )
    try:

        async def ready() -> bool:
            h = (await gw.get(f"/api/allocations/hosts/{host['host_id']}")).json()
            return h.get("status") == "ready"

        await eventually(ready, 60, "host ready")
        allocs: list[str] = []
        for i in range(5):

            async def create(i: int = i) -> str | None:
                try:
                    a = await alice.request(
                        "POST",
                        f"/api/allocations/projects/{pid}/allocations",
                        json={"gpu_model": "H100-80GB", "gpu_count": 1, "name": f"n{i}"},
                    )
                except ApiError:
                    return None
                return a["allocation_id"]

            allocs.append(await eventually(create, 60, "allocation created"))
        for aid in allocs:

            async def active(aid: str = aid) -> bool:
                return (await alice.request("GET", f"/api/allocations/allocations/{aid}"))["status"] == "active"

            await eventually(active, 90, "allocation active")
        yield {
            "alice": alice,
            "ctl": ctl,
            "sa": sa,
            "pid": pid,
            "tid": tid,
            "slug": slug,
            "allocs": allocs,
            "gw": gw,
            "stack": stack,
        }
    finally:
        stop_process(agent)
        await alice.aclose()
        await ctl.aclose()


async def test_controller_on_the_real_stack(world: dict[str, Any]) -> None:
    alice: Client = world["alice"]
    ctl: Client = world["ctl"]
    stack: Stack = world["stack"]
    slug, pid = world["slug"], world["pid"]
    a_ctl, a_w1, a_w2, a_bad, a_hang = (uuid.UUID(a) for a in world["allocs"])

    async def deploy() -> Any:
        try:
            return await alice.deploy(
                pid,
                name="hpc",
                app_slug=slug,
                config={"partition": "gpu"},
                placement=PlacementIntent(mode="split", controller_allocation_id=a_ctl, worker_allocation_ids=[a_w1]),
            )
        except ApiError as exc:  # app-runtime's projections catch up with catalog and allocations
            assert exc.code in (
                "app_not_found",
                "app_not_entitled",
                "allocation_not_in_project",
                "allocation_not_active",
                "project_not_found",
                "not_found",
            ), exc.problem
            return None

    inst = await eventually(deploy, 60, "deploy accepted")
    iid = inst.instance_id

    async def bind() -> bool:
        try:
            await alice.bind_controller(pid, slug, world["sa"]["service_account_id"])
            return True
        except ApiError as exc:
            assert exc.code == "service_account_invalid", exc.problem
            return False

    await eventually(bind, 60, "controller bound")

    async def status(*wanted: str) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return (await alice.instance(iid)).status in wanted

        return check

    # the UI's live timeline, through the gateway's SSE passthrough
    seen: list[str] = []

    async def listen() -> None:
        try:
            async for entry in alice.stream_timeline(iid):
                seen.append(entry.kind)
        except httpx.HTTPError:  # the stream ends with the test
            pass

    listener = asyncio.create_task(listen())
    adapter = SshSlurm()
    loop = ReconcileLoop(ctl, app_slug=slug, controller=adapter, lease_s=15, poll_interval_s=0.3, holder="replica-a")

    # deploy → running; the credential reached the allocations as an app access grant
    await drive(loop, await status("running"))
    cred = await alice.credential(iid)
    grants = await alice.request("GET", f"/api/allocations/allocations/{a_w1}/ssh-grants")
    assert any(
        g["origin"] == "app_access_grant" and g["fingerprint"] == cred.fingerprint and g["status"] == "active"
        for g in grants
    ), grants
    secret = await ctl.fetch_credential(iid)
    key = asyncssh.import_private_key(secret.private_key)
    assert key.export_public_key().decode().strip() == cred.public_key
    with pytest.raises(ApiError) as err:
        await alice.fetch_credential(iid)
    assert err.value.status == 403

    async def live() -> list[Any]:
        return await alice.members(iid)

    async def n_active(n: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            ms = await live()
            return len(ms) == n and all(m.status == "active" for m in ms)

        return check

    # add a worker on a second allocation; remove it and add it back
    await alice.request_operation(iid, "add", allocation_id=a_w2)
    await drive(loop, await n_active(3))
    w2 = next(m for m in await live() if m.allocation_id == a_w2)
    await alice.request_operation(iid, "remove", member_id=w2.member_id)
    await drive(loop, await n_active(2))
    remove_op = next(o for o in await alice.operations(iid) if o.kind == "remove")
    assert remove_op.result["teardown_verified"] is True
    await alice.request_operation(iid, "add", allocation_id=a_w2)
    await drive(loop, await n_active(3))

    # a worker that fails bootstrap → degraded; recover → running; the failed member stays a tombstone
    adapter.fail_bootstrap.add(a_bad)
    await alice.request_operation(iid, "add", allocation_id=a_bad)
    await drive(loop, await status("degraded"))
    bad = next(m for m in await live() if m.allocation_id == a_bad)
    assert bad.status == "failed"
    await alice.request_operation(iid, "recover", member_id=bad.member_id)
    await drive(loop, await status("running"))
    tomb = next(m for m in await alice.members(iid, include_tombstones=True) if m.member_id == bad.member_id)
    assert tomb.tombstoned and tomb.status == "failed"

    # a controller process killed mid-operation: its lease expires and another replica finishes
    env = {
        **os.environ,
        "GPUAAS_URL": stack.gateway_url,
        "GPUAAS_CLIENT_ID": world["sa"]["client_id"],
        "GPUAAS_CLIENT_SECRET": world["sa"]["client_secret"],
        "APP_SLUG": slug,
        "HANG_ON": str(a_hang),
        "LEASE_S": "6",
        "HOLDER": "doomed",
    }
    log = open(stack.logs_dir / "app-controller-doomed.log", "ab")  # noqa: SIM115, ASYNC230 - handed to the child
    proc = subprocess.Popen(  # noqa: ASYNC220 - starting, not waiting
        [sys.executable, str(Path(__file__).with_name("app_runtime_controller.py"))],
        env=env,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    try:
        hang_op = await alice.request_operation(iid, "add", allocation_id=a_hang)

        async def held_by_doomed() -> bool:
            ops = {o.operation_id: o for o in await alice.operations(iid)}
            return "doomed" in (ops[hang_op.operation_id].claimed_by or "")

        await eventually(held_by_doomed, 60, "the doomed controller claimed the operation")
    finally:
        stop_process(proc, signal.SIGKILL)
    await drive(loop, await n_active(5))
    finished = next(o for o in await alice.operations(iid) if o.operation_id == hang_op.operation_id)
    assert finished.status == "succeeded" and finished.attempt == 2 and "replica-a" in (finished.claimed_by or "")

    # releasing an allocation removes its member first (saga), then allocations releases it
    await alice.request("POST", f"/api/allocations/allocations/{a_bad}/release")

    async def released() -> bool:
        a = await alice.request("GET", f"/api/allocations/allocations/{a_bad}")
        return a["status"] == "released"

    await drive(loop, released, timeout_s=120)
    assert all(m.allocation_id != a_bad for m in await live())
    timeline = await alice.request("GET", f"/api/allocations/allocations/{a_bad}/timeline")
    assert any(t.get("phase") == "release.clearance" and t.get("status") == "succeeded" for t in timeline), timeline

    # honest decommission with verified teardown of every member
    await alice.decommission(iid, "cluster retired")
    await drive(loop, await status("decommissioned", "decommission_failed"))
    done = await alice.instance(iid)
    assert done.status == "decommissioned" and done.decommission and not done.decommission.forced
    assert len(done.decommission.verified_member_ids) == 4

    async def grant_revoked() -> bool:
        gs = await alice.request("GET", f"/api/allocations/allocations/{a_w1}/ssh-grants")
        return all(g["status"] == "revoked" for g in gs if g["origin"] == "app_access_grant")

    await eventually(grant_revoked, 60, "access grant revoked on the allocations")
    await eventually(lambda: _has(seen, "instance.decommissioned"), 20, "SSE saw the decommission")
    listener.cancel()
    await asyncio.gather(listener, return_exceptions=True)
    for kind in (
        "instance.created",
        "operation.claimed",
        "member.tombstoned",
        "controller.node_joined",
        "instance.degraded",
        "instance.running",
        "instance.decommissioning",
    ):
        assert kind in seen, kind

    # a decommission whose teardown cannot be verified fails with the evidence; the forced path is recorded
    second = await alice.deploy(
        pid,
        name="solo",
        app_slug=slug,
        config={"partition": "x"},
        placement=PlacementIntent(mode="same_node", controller_allocation_id=a_ctl),
    )
    await drive(loop, (lambda: _status_is(alice, second.instance_id, "running")))
    adapter.unverified.add(a_ctl)
    await alice.decommission(second.instance_id, "try")
    await drive(loop, (lambda: _status_is(alice, second.instance_id, "decommission_failed")))
    failed = await alice.instance(second.instance_id)
    assert failed.decommission and failed.decommission.unverified_member_ids
    assert any("NOT verified" in e for e in failed.decommission.evidence)
    forced = await alice.force_decommission(second.instance_id, "host reimaged by operator")
    assert forced.status == "decommissioned" and forced.decommission and forced.decommission.forced

    async def audited() -> bool:
        r = await world["gw"].get("/api/identity/audit", params={"action": "apps.instance.decommission.force"})
        return any(
            e["resource_id"] == str(second.instance_id) and e["reason"] == "host reimaged by operator"
            for e in r.json()["items"]
        )

    await eventually(audited, 60, "forced decommission in the audit store")


async def _has(items: list[str], kind: str) -> bool:
    return kind in items


async def _status_is(client: Client, instance_id: uuid.UUID, wanted: str) -> bool:
    return (await client.instance(instance_id)).status == wanted
