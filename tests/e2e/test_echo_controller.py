"""The guide's example controller (examples/echo-controller) on the real stack, as an app team would run it:
published through the SDK's catalog calls (a real OCI registry, checks, promotion gates, manifest, entitlement),
a service account bound as its controller, the controller run by `gpuaas-controller run` as its own process
(SIGTERM, /healthz, /metrics), real processes started over SSH in the members, scale up and down, and a
decommission whose teardown the controller verified."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuaas.devstack.golden_path.actors import start_agent
from gpuaas.devstack.infra import free_port, stop_process
from gpuaas.devstack.pytest_plugin import target_of
from gpuaas.devstack.registry import LocalRegistry, RegistryMissing
from gpuaas.devstack.stack import Stack
from gpuaas.sdk import ApiError
from gpuaas.sdk.controller import MemberShell
from gpuaas.sdk.controller.harness import Harness, Team, wait
from gpuaas.sdk.models import PlacementIntent

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "echo-controller"
sys.path.insert(0, str(EXAMPLE / "src"))  # the example as an app team has it (installed once uv.lock has it)
from echo_controller import MANIFEST  # noqa: E402


@pytest.fixture(scope="module")
def registry() -> Iterator[LocalRegistry]:
    root = Path(tempfile.mkdtemp(prefix="gpuaas-e2e-echo-registry-"))
    try:
        reg = LocalRegistry(root).start()
    except RegistryMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    yield reg
    reg.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def harness(stack: Stack, admin_token: str) -> AsyncIterator[Harness]:
    h = Harness(stack.gateway_url, admin_token)
    yield h
    await h.aclose()


async def _allocations(stack: Stack, gw: httpx.AsyncClient, team: Team, n: int) -> tuple[list[str], Any]:
    run = uuid.uuid4().hex[:6]
    host = (await gw.post("/api/allocations/hosts", json={"name": f"echo-{run}"})).json()
    agent = start_agent(target_of(stack), host["node_token"], f"echo-{run}", "8xH100-80GB")

    async def ready() -> bool:
        return (await gw.get(f"/api/allocations/hosts/{host['host_id']}")).json().get("status") == "ready"

    await wait(ready, "host ready", timeout_s=60)
    ids = []
    for i in range(n):

        async def create(i: int = i) -> str | None:
            try:
                body = {"gpu_model": "H100-80GB", "gpu_count": 1, "name": f"echo-{i}"}
                a = await team.user.request(
                    "POST", f"/api/allocations/projects/{team.project_id}/allocations", json=body
                )
            except ApiError:
                return None  # allocations learns of the new project through identity's events
            return str(a["allocation_id"])

        ids.append(await wait(create, "allocation created", timeout_s=60))
    for aid in ids:

        async def active(aid: str = aid) -> bool:
            return (await team.user.request("GET", f"/api/allocations/allocations/{aid}"))["status"] == "active"

        await wait(active, "allocation active", timeout_s=90)
    return ids, agent


def _run_controller(stack: Stack, team: Team, slug: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(EXAMPLE / "src"), os.environ.get("PYTHONPATH", "")]),
        "GPUAAS_URL": stack.gateway_url,
        "GPUAAS_CLIENT_ID": team.service_account["client_id"],
        "GPUAAS_CLIENT_SECRET": team.service_account["client_secret"],
        "GPUAAS_POLL_S": "0.3",
        "GPUAAS_RECONCILE_EVERY_S": "2",
    }
    cmd = [sys.executable, "-m", "gpuaas.sdk.controller.runner", "run", "echo_controller:EchoController"]
    cmd += ["--app-slug", slug, "--port", str(port), "--lease-s", "20"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)


async def test_echo_controller_from_publishing_to_decommission(
    stack: Stack, gw: httpx.AsyncClient, harness: Harness, registry: LocalRegistry, tmp_path: Path
) -> None:
    team = await harness.team("echo")
    slug = f"echo-{uuid.uuid4().hex[:6]}"
    manifest = await harness.publish(team, {**MANIFEST, "slug": slug}, registry=registry.address)
    assert manifest.active and manifest.artifact_kind == "controller"
    (a_server, a_w1, a_w2), agent = await _allocations(stack, gw, team, 3)
    user = team.user

    async def deploy() -> Any:
        try:
            return await user.deploy(
                team.project_id,
                name="echo",
                app_slug=slug,
                config={"greeting": "hello from echo"},
                placement=PlacementIntent(
                    mode="split", controller_allocation_id=a_server, worker_allocation_ids=[a_w1]
                ),
            )
        except ApiError as exc:  # app-runtime's projections of catalog and allocations catch up
            if exc.code not in ("app_not_found", "app_not_entitled", "allocation_not_in_project", "not_found"):
                raise
            return None

    iid = (await wait(deploy, "deploy accepted", timeout_s=60)).instance_id
    await team.bind(slug)
    port, log = free_port(), tmp_path / "controller.log"
    proc = _run_controller(stack, team, slug, port, log)
    try:

        async def healthy(workers: int) -> bool:
            inst = await user.instance(iid)
            return (
                inst.status == "running"
                and inst.health.status == "healthy"
                and inst.runtime_detail.get("workers") == workers
            )

        await wait(lambda: healthy(1), "echo running with 1 worker", timeout_s=240)
        inst = await user.instance(iid)
        assert inst.runtime_detail["url"].endswith("/index.html")
        members = {m.component_key: m for m in await user.members(iid)}
        assert members["server"].detail["port"] > 0 and members["worker"].detail["pid"] > 0  # member_detail sent
        state = await team.controller.controller_state(iid)  # the controller's state, on the platform
        assert state["version"] >= 1 and state["state"]["server"]["url"] == inst.runtime_detail["url"]
        async with httpx.AsyncClient() as http:  # the server is real and answers the configured greeting
            assert (await http.get(inst.runtime_detail["url"])).text == "hello from echo"

        # scale up: a second worker on another allocation
        await user.request_operation(iid, "add", allocation_id=a_w2, component_key="worker")
        await wait(lambda: healthy(2), "echo running with 2 workers", timeout_s=180)
        w2 = next(m for m in await user.members(iid) if m.allocation_id == uuid.UUID(a_w2))
        pid = int(w2.detail["pid"])
        shell = MemberShell(team.controller, iid, a_w2)  # look for ourselves: the worker's process is real
        alive = await shell.run(f"kill -0 {pid} && cat ~/echo/{w2.member_id}/last")
        assert alive.stdout.strip() == "hello from echo"

        # scale down: remove it; the controller verifies the process is gone
        await user.request_operation(iid, "remove", member_id=w2.member_id)

        async def removed() -> Any:
            ops = [o for o in await user.operations(iid) if o.kind == "remove" and o.status == "succeeded"]
            return ops[0] if ops else None

        remove_op = await wait(removed, "worker removed", timeout_s=120)
        assert remove_op.result["teardown_verified"] is True, remove_op.result
        assert f"process {pid} gone" in remove_op.result["evidence"], remove_op.result
        await wait(lambda: healthy(1), "echo back to 1 worker", timeout_s=120)

        # liveness and metrics of the runner
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as probe:
            assert (await probe.get("/healthz")).status_code == 200
            metrics = (await probe.get("/metrics")).text
        assert 'gpuaas_controller_operations_total{kind="add",outcome="succeeded"} 3.0' in metrics
        assert 'gpuaas_controller_reconciles_total{outcome="ok"}' in metrics

        # decommission: every member removed with verified teardown
        await user.decommission(iid, "done")

        async def decommissioned() -> Any:
            inst = await user.instance(iid)
            return inst if inst.status in ("decommissioned", "decommission_failed") else None

        final = await wait(decommissioned, "decommission finished", timeout_s=180)
        assert final.status == "decommissioned", final.decommission
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.TransportError):
                await http.get(inst.runtime_detail["url"], timeout=2)
    finally:
        proc.send_signal(signal.SIGTERM)  # graceful: finishes what it holds, then exits 0
        try:
            code = await asyncio.to_thread(proc.wait, 30)
        finally:
            if proc.poll() is None:
                proc.kill()
            stop_process(agent)
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert "controller_stopped" in output and "operation_succeeded" in output
    assert "claim_idle" not in output  # idle polls are DEBUG
