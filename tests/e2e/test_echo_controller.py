"""docs/app-controllers.md, run: the guide's own steps (tests/e2e/guide.py), in the guide's order, on the e2e stack,
as an app team would run them with its example controller (examples/echo-controller). The team's tenant, project
and users, its allocations, publishing through the SDK's catalog calls (a real OCI registry, checks, promotion
gates, manifest, entitlement), the service account bound as its controller, the controller run by the guide's
`gpuaas-controller run` command as its own process (SIGTERM, /healthz, /metrics), real processes started over SSH
in the members, scale up and down, and a decommission whose teardown the controller verified. Between the steps
this test checks what the guide promises; the steps themselves are the guide's text, so the guide cannot drift."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpuaas.devstack.golden_path.actors import start_agent
from gpuaas.devstack.infra import free_port, stop_process
from gpuaas.devstack.pytest_plugin import target_of
from gpuaas.devstack.registry import LocalRegistry, RegistryMissing
from gpuaas.devstack.stack import Stack
from gpuaas.sdk import Client
from gpuaas.sdk.controller import MemberShell
from gpuaas.sdk.controller.harness import wait
from tests.e2e.guide import Guide, Step

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "echo-controller"


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


def _workdir(stack: Stack, registry: LocalRegistry, root: Path) -> Path:
    """A directory laid out as the guide expects of a `make run` checkout: `.local/stack.json` (this stack's, with
    the test's registry), `examples/` and the controller's package in `dist/echo.tar.gz`."""
    (root / ".local").mkdir(parents=True)
    state = stack.state() | {"registry": {"address": registry.address}}
    (root / ".local" / "stack.json").write_text(json.dumps(state, default=str))
    (root / "examples").symlink_to(ROOT / "examples")
    package = io.BytesIO()
    with tarfile.open(fileobj=package, mode="w:gz") as tar:  # what `tar czf dist/echo.tar.gz -C ... src` makes
        tar.add(EXAMPLE / "src", "src", filter=lambda i: None if "__pycache__" in i.name else i)
    (root / "dist").mkdir()
    (root / "dist" / "echo.tar.gz").write_bytes(package.getvalue())
    return root


async def _capacity(stack: Stack, gw: httpx.AsyncClient) -> subprocess.Popen[bytes]:
    """A host of its own for the team's allocations (the operator's capacity: before the guide starts)."""
    run = uuid.uuid4().hex[:6]
    host = (await gw.post("/api/allocations/hosts", json={"name": f"echo-{run}"})).json()
    agent = start_agent(target_of(stack), host["node_token"], f"echo-{run}", "8xH100-80GB")

    async def ready() -> bool:
        return (await gw.get(f"/api/allocations/hosts/{host['host_id']}")).json().get("status") == "ready"

    await wait(ready, "host ready", timeout_s=60)
    return agent


def _run_controller(step: Step, ns: dict[str, Any], port: int, log: Path) -> subprocess.Popen[bytes]:
    """The guide's `run` command as it stands, with the names it uses from the Python steps; faster polls and a
    free health port through the runner's environment variables."""
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "GATEWAY": ns["GATEWAY"],
        "CLIENT_ID": ns["CLIENT_ID"],
        "CLIENT_SECRET": ns["CLIENT_SECRET"],
        "GPUAAS_HEALTH_PORT": str(port),
        "GPUAAS_POLL_S": "0.3",
        "GPUAAS_RECONCILE_EVERY_S": "2",
        "GPUAAS_LEASE_S": "20",
    }
    # bash runs a lone command in place (exec), so the pid is the controller's and SIGTERM reaches it
    return subprocess.Popen(
        ["bash", "-c", step.source], env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


async def test_the_guide_from_publishing_to_decommission(
    stack: Stack,
    gw: httpx.AsyncClient,
    registry: LocalRegistry,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(_workdir(stack, registry, tmp_path / "checkout"))
    agent = await _capacity(stack, gw)
    guide = Guide()
    ns = guide.ns
    proc: subprocess.Popen[bytes] | None = None
    controller: Client | None = None
    try:
        for step in ("stack", "team"):
            await guide.run(step)
        try:
            await guide.run("allocations", timeout_s=150)  # a failed one raises, naming why
        except TimeoutError:  # say where it stopped (queued, provisioning)
            last = ns.get("a")  # the step's last read of the allocation it waits for
            pytest.fail(f"allocation not active: {last and (last.status, last.pending_reason, last.queue_position)}")
        for step in ("publish", "project"):
            await guide.run(step)
        assert ns["registered"].active and ns["registered"].artifact_kind == "controller"
        port, log = free_port(), tmp_path / "controller.log"
        proc = _run_controller(guide.step("run"), ns, port, log)
        user = ns["user"]
        controller = Client(ns["GATEWAY"])  # the service account, to look into the members ourselves
        controller.use_client_credentials(ns["CLIENT_ID"], ns["CLIENT_SECRET"])

        await guide.run("deploy")
        iid = ns["inst"].instance_id

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
        state = await controller.controller_state(iid)  # the controller's state, on the platform
        assert state["version"] >= 1 and state["state"]["server"]["url"] == inst.runtime_detail["url"]
        async with httpx.AsyncClient() as http:  # the server is real and answers the configured greeting
            assert (await http.get(inst.runtime_detail["url"])).text == "hello from echo"

        await guide.run("scale-up")  # a second worker on the third allocation
        await wait(lambda: healthy(2), "echo running with 2 workers", timeout_s=180)
        a_w2 = ns["A2"]
        w2 = next(m for m in await user.members(iid) if m.allocation_id == a_w2)
        pid = int(w2.detail["pid"])
        shell = MemberShell(controller, iid, str(a_w2))  # look for ourselves: the worker's process is real
        alive = await shell.run(f"kill -0 {pid} && cat ~/echo/{w2.member_id}/last")
        assert alive.stdout.strip() == "hello from echo"

        await guide.run("scale-down")  # removed; the controller verifies the process is gone
        assert ns["worker"].member_id == w2.member_id

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

        await guide.run("decommission")  # every member removed with verified teardown
        assert ns["final"].status == "decommissioned", ns["final"].decommission
        assert guide.remaining() == []  # every step of the guide ran
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.TransportError):
                await http.get(inst.runtime_detail["url"], timeout=2)
    finally:
        code = None
        if proc is not None:
            proc.send_signal(signal.SIGTERM)  # graceful: finishes what it holds, then exits 0
            try:
                code = await asyncio.to_thread(proc.wait, 30)
            finally:
                if proc.poll() is None:
                    proc.kill()
        stop_process(agent)
        for client in (controller, ns.get("op"), ns.get("user"), ns.get("lead")):
            if isinstance(client, Client):
                await client.aclose()
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert "controller_stopped" in output and "operation_succeeded" in output
    assert "claim_idle" not in output  # idle polls are DEBUG
