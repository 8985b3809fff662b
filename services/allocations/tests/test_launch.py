"""Launchable apps (issue 21) from allocations' side, through the real broker: app-runtime's
`instance.created` with a `launch` request makes allocations create the instance's allocation on a
container host from the app's image (checked against the catalog's artifacts), with the workload and its
per-instance secret in the provision task only; the agent's health-checked port becomes the allocation's
`workload_endpoint` on the ENROLLED host address; an image the catalog does not offer is a failed launch."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import select

from gpuaas.allocations.models import allocations, catalog_artifacts
from gpuaas.contracts.enums import InstanceStatus
from gpuaas.contracts.events import app_runtime as ar
from gpuaas.kit import workload_tokens
from gpuaas.kit.testing import wait_for

from .conftest import World, publish_events
from .test_runtimes import Catalog, container_host

pytestmark = pytest.mark.integration
KEY = "k" * 40


def created(w: World, catalog: Catalog, key: str, gpu_model: str) -> ar.InstanceCreated:
    art = catalog.artifacts[key]
    iid, alloc = uuid.uuid4(), uuid.uuid4()
    launch = ar.LaunchRequest(
        allocation_id=alloc,
        gpu_model=gpu_model,
        gpu_count=1,
        app_slug="jupyter",
        app_version="1.1.0",
        image=art.ref,
        digest=art.digest,
        workload={
            "instance_id": str(iid),
            "command": ["jupyter", "lab", "--ServerApp.base_url={base_path}"],
            "port": 8888,
            "health_path": "/api/status",
            "base_path": f"/apps/{iid}/",
            "auth_env": "JUPYTER_TOKEN",
        },
    )
    state = ar.InstanceState(
        instance_id=iid,
        tenant_id=w.ids["t1"],
        project_id=w.ids["p1"],
        name="lab",
        app_slug="jupyter",
        app_version="1.1.0",
        manifest_id=uuid.uuid4(),
        artifact_digest=art.digest,
        status=InstanceStatus.created,
        status_changed_at=datetime.now(UTC),
        placement_intent=ar.PlacementIntent(
            mode="launch", gpu_model=gpu_model, gpu_count=1, launch_allocation_id=alloc
        ),
        version=1,
        launch=launch,
    )
    return ar.InstanceCreated.build(data=state, source="app-runtime")


async def test_launch_creates_the_allocation_and_records_the_workload_endpoint(
    world: World, infra, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(workload_tokens.ENV, KEY)
    w = world
    await wait_for(lambda: w.kit.consumer is not None and w.kit.consumer.assigned, 60, "consumer assignment")
    model = f"L{uuid.uuid4().hex[:4]}-24GB"
    host = f"launch-{uuid.uuid4().hex[:6]}"  # this test's hosts only
    agent = await container_host(w, host, gpus=[{"index": 0, "model": model, "memory_mb": 24576}], ssh_host="10.9.8.7")
    catalog = Catalog()
    key, staged = f"j{uuid.uuid4().hex[:6]}@1.1.0", f"s{uuid.uuid4().hex[:6]}@1.0.0"
    await publish_events(infra.kafka_bootstrap, catalog.artifact(key, "active"), catalog.artifact(staged, "staged"))

    async def projected() -> bool:  # the catalog and app-runtime topics are not ordered with each other
        digests = [catalog.artifacts[k].digest for k in (key, staged)]
        async with w.kit.sessions() as s:
            rows = (await s.execute(select(catalog_artifacts).where(catalog_artifacts.c.digest.in_(digests)))).all()
        return len(rows) == 2

    await wait_for(projected, 60, "the catalog's artifacts projected")
    try:
        good = created(w, catalog, key, model)
        await publish_events(infra.kafka_bootstrap, good)
        alloc_id = str(good.data.launch.allocation_id)
        # from an event through the consumer (batching, a loaded machine): longer than an API-made task
        try:
            task = await agent.task_for(alloc_id, "provision", timeout_s=90)
        except TimeoutError:
            async with w.kit.sessions() as s:
                row = (
                    await s.execute(select(allocations).where(allocations.c.allocation_id == uuid.UUID(alloc_id)))
                ).first()
            raise AssertionError(f"no provision task; the allocation: {row and row._asdict()}") from None
        p = task["payload"]
        assert p["runtime"]["digest"] == catalog.artifacts[key].digest
        assert p["workload"]["port"] == 8888 and p["workload"]["base_path"] == f"/apps/{good.data.instance_id}/"
        assert p["workload_token"] == workload_tokens.derive(KEY.encode(), good.data.instance_id)
        async with w.client("owner") as c:
            alloc = (await c.get(f"/allocations/{alloc_id}")).json()
        assert alloc["status"] == "provisioning" and alloc["project_id"] == str(w.ids["p1"]), alloc
        # The agent reports another host: the endpoint is the enrolled one, with the reported port.
        await agent.complete(task, ssh_host="203.0.113.9", workload={"host_port": 41234, "healthy": True})

        async def runtime_of(allocation_id: str) -> dict:
            async with w.kit.sessions() as s:
                row = (
                    await s.execute(select(allocations).where(allocations.c.allocation_id == uuid.UUID(allocation_id)))
                ).one()
                return {"status": row.status, "runtime": row.runtime, "failure_reason": row.failure_reason}

        async def active() -> dict | None:
            got = await runtime_of(alloc_id)
            return got if got["status"] == "active" else None

        got = await wait_for(active, 20, "launch allocation active")
        assert got["runtime"]["workload_endpoint"] == {"host": "10.9.8.7", "port": 41234, "healthy": True}
        assert "workload_token" not in str(got["runtime"])  # the secret is kept nowhere

        # An image the catalog does not offer (staged): the launch is a failed allocation with the reason.
        bad = created(w, catalog, staged, model)
        await publish_events(infra.kafka_bootstrap, bad)

        async def failed() -> dict | None:
            try:
                got = await runtime_of(str(bad.data.launch.allocation_id))
            except Exception:
                return None
            return got if got["status"] == "failed" else None

        got = await wait_for(failed, 60, "refused launch recorded as failed")
        assert "launch failed" in got["failure_reason"] and "staged" in got["failure_reason"], got
    finally:
        await agent.aclose()
