"""Runtime images from the catalog topic (real broker) and what a create makes of them: resolution of
`runtime` in each form, retired / deprecated / unknown refused (422 runtime_unavailable), the host
class's default, the limits of the container (class figures x GPUs, else the host's share) and the
runtime and limits in the provision / resize task payloads the agent receives."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import pytest

from gpuaas.contracts import Event
from gpuaas.contracts.events import catalog as cat
from gpuaas.kit.testing import wait_for

from .conftest import FakeAgent, World, publish_events

pytestmark = pytest.mark.integration
REGISTRY = "127.0.0.1:5999/runtimes"


def digest(seed: str) -> str:
    return "sha256:" + hashlib.sha256(seed.encode()).hexdigest()


class Catalog:
    """Catalog events for runtime manifests and their artifacts, as catalog publishes them."""

    def __init__(self) -> None:
        self.artifacts: dict[str, cat.ArtifactState] = {}
        self.manifest_ids: dict[str, uuid.UUID] = {}

    def artifact(self, key: str, state: str = "active", canary: list[uuid.UUID] | None = None) -> Event:
        previous = self.artifacts.get(key)
        d = digest(key)
        art = cat.ArtifactState(
            artifact_id=previous.artifact_id if previous else uuid.uuid4(),
            kind=cat.ArtifactKind.oci,
            ref=f"{REGISTRY}/{key.split('@')[0]}@{d}",
            digest=d,
            state=cat.ArtifactLifecycle(state),
            canary_tenants=canary or [],
            version=previous.version + 1 if previous else 1,
        )
        self.artifacts[key] = art
        if previous is None:
            return cat.ArtifactRegistered.build(data=art, source="catalog")
        moved = cat.ArtifactTransition(**art.model_dump(), from_state=previous.state, reason="test")
        return cat.ArtifactTransitioned.build(data=moved, source="catalog")

    def manifest(self, key: str, *, active: bool = True, deprecated: bool = False, revision: int = 1) -> Event:
        slug, version = key.split("@")
        art = self.artifacts[key]
        m = cat.AppManifestState(
            manifest_id=self.manifest_ids.setdefault(key, uuid.uuid4()),
            slug=slug,
            display_name=slug.title(),
            version=version,
            artifact_kind=cat.AppArtifactKind.runtime,
            artifact_ref=art.ref,
            artifact_id=art.artifact_id,
            active=active,
            deprecated=deprecated,
            revision=revision,
        )
        kind = cat.AppDeprecated if deprecated else cat.AppRegistered if revision == 1 else cat.AppUpdated
        return kind.build(data=m, source="catalog")


async def offered(w: World, expect: set[str], absent: frozenset[str] | set[str] = frozenset()) -> list[dict[str, Any]]:
    """GET /runtimes once the projection offers every `expect` and none of `absent` (slug@version). The
    broker's topic outlives a test, so earlier tests' runtimes may be offered too."""
    async with w.client("owner") as c:

        async def check() -> list[dict[str, Any]] | None:
            items = (await c.get("/runtimes", params={"project_id": str(w.ids["p1"])})).json()
            seen = {f"{i['slug']}@{i['version']}" for i in items}
            return items if expect <= seen and not absent & seen else None

        return list(await wait_for(check, 30, f"runtimes {sorted(expect)} offered, {sorted(absent)} not"))


async def container_host(w: World, name: str, host_class: str | None = None, **register: Any) -> FakeAgent:
    async with w.client("op") as c:
        r = await c.post("/hosts", json={"name": name, "host_class": host_class})
        assert r.status_code == 201, r.text
    agent = FakeAgent(w.url, r.json()["node_token"])
    r = await agent.register(**register)
    assert r.status_code == 200, r.text
    return agent


async def test_runtime_resolution_each_form_and_refusals(world: World, infra) -> None:
    w = world
    await wait_for(lambda: w.kit.consumer is not None and w.kit.consumer.assigned, 60, "consumer assignment")
    catalog = Catalog()
    u = f"t{uuid.uuid4().hex[:6]}-"  # slugs of this test only (the topic outlives it)
    events = [
        catalog.artifact(f"{u}base@1.0.0"),
        catalog.manifest(f"{u}base@1.0.0"),
        catalog.artifact(f"{u}base@1.10.0"),  # newer than 1.9.0: versions compare numerically
        catalog.manifest(f"{u}base@1.10.0"),
        catalog.artifact(f"{u}base@1.9.0"),
        catalog.manifest(f"{u}base@1.9.0"),
        catalog.artifact(f"{u}scipy@1.0.0"),
        catalog.manifest(f"{u}scipy@1.0.0"),
        catalog.artifact(f"{u}old@1.0.0"),
        catalog.manifest(f"{u}old@1.0.0"),
        catalog.artifact(f"{u}canary@0.1.0", state="canary", canary=[w.ids["t2"]]),
        catalog.manifest(f"{u}canary@0.1.0", active=False),
    ]
    await publish_events(infra.kafka_bootstrap, *events)
    await offered(w, {f"{u}base@1.0.0", f"{u}base@1.9.0", f"{u}base@1.10.0", f"{u}scipy@1.0.0", f"{u}old@1.0.0"})
    # The catalog retires scipy's artifact and deprecates the old runtime's manifest.
    await publish_events(
        infra.kafka_bootstrap,
        catalog.artifact(f"{u}scipy@1.0.0", state="deprecated"),
        catalog.artifact(f"{u}scipy@1.0.0", state="retired"),
        catalog.manifest(f"{u}old@1.0.0", active=False, deprecated=True, revision=2),
    )
    listed = await offered(
        w, {f"{u}base@1.0.0", f"{u}base@1.9.0", f"{u}base@1.10.0"}, absent={f"{u}scipy@1.0.0", f"{u}old@1.0.0"}
    )
    assert [i["version"] for i in listed if i["slug"] == f"{u}base"] == ["1.10.0", "1.9.0", "1.0.0"]  # newest first

    agent = await container_host(w, "ctr-1")
    try:

        async def create(runtime: str | None, who: str = "owner", project: str = "p1") -> dict[str, Any]:
            r = await w.create(who, project, **({"runtime": runtime} if runtime is not None else {}))
            assert r.status_code == 201, r.text
            return dict(r.json())

        newest = await create(f"{u}base")
        assert newest["runtime"] == {
            "slug": f"{u}base",
            "version": "1.10.0",
            "image": catalog.artifacts[f"{u}base@1.10.0"].ref,
            "digest": digest(f"{u}base@1.10.0"),
        }
        assert newest["driver"] == "container"
        task = await agent.task_for(newest["allocation_id"], "provision")
        assert task["payload"]["runtime"] == {
            "image": catalog.artifacts[f"{u}base@1.10.0"].ref,
            "digest": digest(f"{u}base@1.10.0"),
        }
        pinned = await create(f"{u}base@1.0.0")
        assert pinned["runtime"]["digest"] == digest(f"{u}base@1.0.0")
        by_digest = await create(digest(f"{u}base@1.9.0"))
        assert (by_digest["runtime"]["slug"], by_digest["runtime"]["version"]) == (f"{u}base", "1.9.0")

        refusals = {
            f"{u}scipy": "retired",
            f"{u}scipy@1.0.0": "retired",
            digest(f"{u}scipy@1.0.0"): "retired",
            f"{u}old": "deprecated",
            f"{u}base@9.9.9": "no runtime",
            "no-such-runtime": "no runtime",
            digest("never-published"): "no runtime",
            "Not A Slug": "not a runtime slug",
            f"{u}canary": "canary",  # a canary exposed to t2 only
        }
        for runtime, why in refusals.items():
            r = await w.create("owner", runtime=runtime)
            assert r.status_code == 422, (runtime, r.text)
            assert r.json()["code"] == "runtime_unavailable" and why in r.json()["detail"], (runtime, r.json())
        # ... while t2, the canary's tenant, may choose it.
        canary = await create(f"{u}canary", who="stranger", project="px")
        assert canary["runtime"]["version"] == "0.1.0"

        # Retiring the newest version moves the slug back one version, at once.
        await publish_events(infra.kafka_bootstrap, catalog.artifact(f"{u}base@1.10.0", state="retired"))
        await offered(w, {f"{u}base@1.0.0", f"{u}base@1.9.0"}, absent={f"{u}base@1.10.0"})
        assert (await create(f"{u}base"))["runtime"]["version"] == "1.9.0"
        r = await w.create("owner", runtime=f"{u}base@1.10.0")
        assert r.status_code == 422 and r.json()["code"] == "runtime_unavailable"
    finally:
        await agent.aclose()


async def test_class_default_runtime_and_limits_in_payloads(world: World, infra) -> None:
    w = world
    await wait_for(lambda: w.kit.consumer is not None and w.kit.consumer.assigned, 60, "consumer assignment")
    catalog = Catalog()
    await publish_events(
        infra.kafka_bootstrap,
        catalog.artifact("gpuaas-base@1.0.0"),
        catalog.manifest("gpuaas-base@1.0.0"),
        catalog.artifact("gpuaas-scipy@1.0.0"),
        catalog.manifest("gpuaas-scipy@1.0.0"),
    )
    await offered(w, {"gpuaas-base@1.0.0", "gpuaas-scipy@1.0.0"})
    async with w.client("op") as op:
        r = await op.put(
            "/host-classes/sci",
            json={"default_runtime": "gpuaas-scipy", "cpus_per_gpu": 3, "memory_mb_per_gpu": 10000, "pids_limit": 512},
        )
        assert r.status_code == 200 and r.json()["version"] == 1, r.text
        r = await op.put("/host-classes/Bad Name", json={})
        assert r.status_code == 422
        r = await op.put("/host-classes/x", json={"default_runtime": "not a slug"})
        assert r.status_code == 422 and r.json()["code"] == "runtime_unavailable"
        async with w.client("owner") as c:
            assert (await c.put("/host-classes/sci", json={})).status_code == 403
            assert (await c.get("/host-classes")).status_code == 403
        classes = (await op.get("/host-classes")).json()
        assert [(k["name"], k["cpus_per_gpu"], k["memory_mb_per_gpu"], k["pids_limit"]) for k in classes] == [
            ("sci", 3.0, 10000, 512)
        ]
    sci = await container_host(w, "sci-1", host_class="sci")  # 16 CPUs, 64 GiB, 8 GPUs
    plain = await container_host(w, "plain-1", host_class="plain")  # a class without a row: no figures
    try:
        # The class's figures x GPUs, its pids limit and its default runtime.
        r = await w.create("owner", gpu_count=2, host_class="sci")
        assert r.status_code == 201, r.text
        a = r.json()
        assert a["runtime"]["slug"] == "gpuaas-scipy"
        assert a["limits"] == {"cpus": 6.0, "memory_mb": 20000, "pids": 512}
        task = await sci.task_for(a["allocation_id"], "provision")
        assert task["payload"]["limits"] == a["limits"]
        assert task["payload"]["runtime"]["digest"] == digest("gpuaas-scipy@1.0.0")
        await sci.complete(task, ssh_host="127.0.0.1", ssh_port=2222)
        await w.wait_status("owner", a["allocation_id"], "active")

        # Resize: the payload carries the limits of the new GPU count; the view takes them when it is done.
        async with w.client("owner") as c:
            r = await c.post(f"/allocations/{a['allocation_id']}/resize", json={"gpu_count": 4})
            assert r.status_code == 202, r.text
        task = await sci.task_for(a["allocation_id"], "resize")
        assert task["payload"]["limits"] == {"cpus": 12.0, "memory_mb": 40000, "pids": 512}
        assert task["payload"]["runtime"]["digest"] == digest("gpuaas-scipy@1.0.0")
        await sci.complete(task)
        resized = await w.wait_status("owner", a["allocation_id"], "active")
        assert resized["gpu_count"] == 4 and resized["limits"]["cpus"] == 12.0

        # No class: the host's share (3 of 8 GPUs of a 16-CPU, 64 GiB host), the default pids limit.
        r = await w.create("owner", gpu_count=3, host_class="plain")
        assert r.status_code == 201, r.text
        b = r.json()
        assert b["host_id"] != a["host_id"]
        assert b["limits"] == {"cpus": 6.0, "memory_mb": 24576, "pids": 4096}
        assert b["runtime"]["slug"] == "gpuaas-base"  # the platform default
    finally:
        await sci.aclose()
        await plain.aclose()


async def test_process_host_runs_no_runtime_and_takes_no_runtime_request(world: World, infra) -> None:
    w = world
    await wait_for(lambda: w.kit.consumer is not None and w.kit.consumer.assigned, 60, "consumer assignment")
    catalog = Catalog()
    await publish_events(
        infra.kafka_bootstrap, catalog.artifact("gpuaas-base@1.0.0"), catalog.manifest("gpuaas-base@1.0.0")
    )
    await offered(w, {"gpuaas-base@1.0.0"})
    agent = await container_host(w, "proc-1", driver="process", isolates_tenants=False)
    try:
        r = await w.create("owner")
        assert r.status_code == 201, r.text
        assert (r.json()["runtime"], r.json()["driver"], r.json()["limits"]) == (None, "process", None)
        task = await agent.task_for(r.json()["allocation_id"], "provision")
        assert task["payload"]["runtime"] is None and task["payload"]["limits"] is None
        # A runtime asks for a container host; there is none.
        r = await w.create("owner", runtime="gpuaas-base", queue=False)
        assert r.status_code == 409 and r.json()["code"] == "insufficient_capacity"
        assert "container host" in r.json()["detail"]
    finally:
        await agent.aclose()
