"""The whole stack as real processes on free ports: start, state file, process control, broker and
database restarts, supervision, stop without leftovers, and data kept across a second start.

One Stack is shared by the module (starting it takes ~30 s on two cores); the tests run in file order
and each leaves every service ready for the next one. The last test stops it and starts a second one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import httpx
import psutil
import pytest
from aiokafka import AIOKafkaConsumer

from gpuaas.devstack.config import GATEWAY, SERVICES, StackInterrupted
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.state import read_json
from gpuaas.devstack.testing import current_children, leftover_processes, remove_root, temp_root

pytestmark = pytest.mark.e2e

ALL = [*SERVICES, GATEWAY]


# Children this test process already had (servers started by other suites of the same session).
PREEXISTING: set[int] = set()


@pytest.fixture(scope="module", autouse=True)
def _record_preexisting_children() -> None:
    PREEXISTING.update(current_children())


@pytest.fixture(scope="module")
def root() -> Iterator[Path]:
    path = temp_root("gpuaas-devstack-test-")
    yield path
    remove_root(path)


@pytest.fixture
def fresh_root() -> Iterator[Path]:
    path = temp_root("gpuaas-devstack-test-")
    yield path
    remove_root(path)


@pytest.fixture(scope="module")
def stack(root: Path) -> Iterator[Stack]:
    s = Stack(root=root, free_ports=True)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def readyz(s: Stack, name: str) -> int:
    try:
        return httpx.get(f"{s.service_url(name)}/readyz", timeout=3).status_code
    except httpx.HTTPError:
        return 0


def alive(pid: int | None) -> bool:
    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stack_pids(s: Stack) -> set[int]:
    pids = {s.pid(n) for n in s.names}
    pids |= {s.pg.pid if s.pg else None, s.tansu.pid if s.tansu else None}
    return {p for p in pids if p}


def test_an_interrupted_start_leaves_nothing(fresh_root: Path) -> None:
    s = Stack(root=fresh_root, free_ports=True)
    timer = threading.Timer(4.0, s.cancel.set)  # Ctrl-C in the runner, mid-start
    timer.start()
    try:
        with pytest.raises(StackInterrupted):
            s.start()
    finally:
        timer.cancel()
    assert leftover_processes(fresh_root, preexisting=PREEXISTING) == []
    assert s.pg is None or not s.pg.running


def test_runner_cli_run_status_stop(fresh_root: Path) -> None:
    """`python -m gpuaas.devstack run` prints the banner and supervises; `status` sees it ready;
    `stop` makes the runner stop everything and exit 0."""
    cli = [sys.executable, "-m", "gpuaas.devstack", "--root", str(fresh_root)]
    runner = subprocess.Popen(
        [*cli, "run", "--free-ports"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out: list[str] = []
    pids: set[int] = set()
    try:
        assert runner.stdout is not None
        for line in runner.stdout:
            out.append(line)
            if "Ctrl-C stops everything" in line:
                break
        text = "".join(out)
        assert "GPUaaS local stack is up" in text, text
        state = read_json(fresh_root / "stack.json")
        assert f"Gateway    {state['gateway']['url']}" in text
        assert state["logins"]["admin"]["password"] in text
        assert state["runner"]["pid"] == runner.pid
        status = subprocess.run([*cli, "status", "--json"], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        assert all(p["readyz"] in ("200", "-") for p in json.loads(status.stdout)["processes"].values())
        pids = {p["pid"] for p in state["processes"].values() if p["pid"]}
        stop = subprocess.run([*cli, "stop"], capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert runner.wait(30) == 0
    finally:
        if runner.poll() is None:
            runner.send_signal(signal.SIGINT)
            runner.wait(60)
    assert leftover_processes(fresh_root, pids, preexisting=PREEXISTING) == []
    assert read_json(fresh_root / "stack.json")["running"] is False


def test_every_service_and_the_gateway_are_ready(stack: Stack) -> None:
    assert stack.names == ALL  # nothing skipped: every module exists and runs
    for name in ALL:
        r = httpx.get(f"{stack.service_url(name)}/readyz", timeout=5)
        assert r.status_code == 200, (name, r.text)
        assert httpx.get(f"{stack.service_url(name)}/healthz", timeout=5).status_code == 200
    assert httpx.get(f"{stack.gateway_url}/healthz", timeout=5).status_code == 200


def test_stack_json_records_urls_pids_and_logins(stack: Stack, root: Path) -> None:
    state = read_json(root / "stack.json")
    assert stat.S_IMODE((root / "stack.json").stat().st_mode) == 0o600
    for key in ("running", "root", "runner", "gateway", "docs", "services", "database", "broker", "logins", "logs"):
        assert key in state, key
    assert state["running"] is True
    assert state["gateway"]["url"] == stack.gateway_url
    assert state["docs"] == f"{stack.gateway_url}/docs"
    assert set(state["services"]) == set(SERVICES)
    for name, info in state["services"].items():
        assert info["url"] == stack.service_url(name)
        assert info["docs"] == f"{stack.service_url(name)}/docs"
        assert info["pid"] == stack.pid(name) and alive(info["pid"])
        assert Path(info["log"]).is_file()
    assert state["gateway"]["pid"] == stack.pid(GATEWAY)
    assert state["database"]["port"] == urlsplit(stack.database_admin_url).port
    assert state["database"]["name"] == "gpuaas"
    assert "***" in state["database"]["url"]  # no password in the URL
    assert state["broker"]["bootstrap"] == stack.kafka_bootstrap
    if stack.pg is not None:
        assert state["database"]["embedded"] and state["database"]["pid"] == stack.pg.pid and alive(stack.pg.pid)
    if stack.tansu is not None:
        assert state["broker"]["embedded"] and state["broker"]["pid"] == stack.tansu.pid and alive(stack.tansu.pid)
        assert state["broker"]["started_at"] == stack.tansu.started_at == state["broker"]["replay_from"]
    assert state["logins"]["admin"] == {"email": stack.admin_login[0], "password": stack.admin_login[1]}
    assert state["runner"]["pid"] == os.getpid()
    assert stat.S_IMODE((root / "secrets.json").stat().st_mode) == 0o600


def test_local_agents_serve_hosts_with_declared_gpus(stack: Stack, root: Path) -> None:
    state = read_json(root / "stack.json")
    assert set(state["agents"]) == {"local-h100", "local-a100"}
    assert all(alive(a["pid"]) for a in state["agents"].values())
    email, password = stack.admin_login
    r = httpx.post(
        f"{stack.gateway_url}/api/identity/auth/token",
        timeout=30,
        data={"grant_type": "password", "username": email, "password": password},
    )
    headers = {"Authorization": f"Bearer {r.json()['access_token']}"}
    # The stack is ready when its services are; each agent then reconciles its host (project networks,
    # firewall chains) before it registers, which on a loaded machine can take a while: wait, bounded.
    deadline = time.monotonic() + 120
    while True:
        hosts = {
            h["name"]: h
            for h in httpx.get(f"{stack.gateway_url}/api/allocations/hosts", headers=headers, timeout=30).json()
        }
        statuses = {name: hosts[name]["status"] for name in ("local-h100", "local-a100") if name in hosts}
        if (set(statuses.values()) == {"ready"} and len(statuses) == 2) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert hosts["local-h100"]["status"] == "ready"
    assert [g["model"] for g in hosts["local-h100"]["gpus"]] == ["H100-80GB"] * 8
    assert hosts["local-a100"]["status"] == "ready"
    assert [g["model"] for g in hosts["local-a100"]["gpus"]] == ["A100-80GB"] * 4


def test_runtime_images_are_seeded_and_the_agents_run_the_container_driver(stack: Stack, root: Path) -> None:
    if not stack.runtimes.enabled:
        pytest.skip("podman or docker-registry is not installed: the stack runs no registry")
    assert stack.runtimes.wait_seeded()  # the default runtime is seeded by start(), the others soon after
    registry = read_json(root / "stack.json")["registry"]
    assert registry["error"] is None and stack.runtimes.seed_error is None
    assert registry["agent_driver"] == "container" and alive(registry["pid"])
    assert set(registry["images"]) == {"gpuaas-base", "gpuaas-scipy", "gpuaas-jupyter", "gpuaas-slurm"}
    base = registry["images"]["gpuaas-base"]
    assert base["ref"] == f"{registry['address']}/runtimes/gpuaas-base@{base['digest']}"
    email, password = stack.admin_login
    r = httpx.post(
        f"{stack.gateway_url}/api/identity/auth/token",
        timeout=30,
        data={"grant_type": "password", "username": email, "password": password},
    )
    headers = {"Authorization": f"Bearer {r.json()['access_token']}"}
    for slug, image in registry["images"].items():
        (manifest,) = httpx.get(f"{stack.gateway_url}/api/catalog/apps/{slug}", headers=headers, timeout=30).json()
        assert manifest["artifact_kind"] == "runtime" and manifest["artifact_ref"] == image["ref"]
        assert manifest["active"] is True and manifest["version"] == "1.0.0"
    for name, agent in read_json(root / "stack.json")["agents"].items():
        environ = psutil.Process(agent["pid"]).environ()
        assert environ["GPUAAS_AGENT_DRIVER"] == "container"
        assert environ["GPUAAS_AGENT_REGISTRY_INSECURE"] == "true"
        assert "GPUAAS_AGENT_NODE_TOKEN" not in environ  # readable from /proc by anyone with the agent's uid
        token_file = Path(environ["GPUAAS_AGENT_NODE_TOKEN_FILE"])
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert token_file.read_text() == stack.credentials.agent_token(name)


async def test_each_service_role_sees_only_its_schema(stack: Stack) -> None:
    assert await stack.fetchval("identity", "SELECT current_user") == "gpuaas_identity"
    assert await stack.fetchval("app_runtime", "SELECT current_schema()") == "app_runtime"
    # Migrated: the kit's tables exist in every service's own schema, and its role can read them.
    kit_tables = ["dead_letters", "idempotency_keys", "inbox", "outbox"]
    for svc in SERVICES:
        found = await stack.fetchval(
            svc,
            "SELECT array_agg(table_name::text ORDER BY table_name) FROM information_schema.tables "
            "WHERE table_schema = $1 AND table_name = ANY($2::text[])",
            svc,
            kit_tables,
        )
        assert found == kit_tables, f"{svc}: {found}"
        assert await stack.fetchval(svc, "SELECT to_regclass('outbox')::text") == "outbox"  # on its search path
        assert isinstance(await stack.fetchval(svc, "SELECT count(*) FROM outbox"), int)
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await stack.fetchval("identity", "SELECT count(*) FROM billing.outbox")


def test_kill_then_start_service(stack: Stack) -> None:
    old = stack.pid("catalog")
    stack.kill("catalog", signal.SIGKILL)
    assert not alive(old)
    assert readyz(stack, "catalog") == 0
    assert read_json(stack.state_path)["services"]["catalog"]["pid"] is None
    # A killed service is intentionally down: supervision does not bring it back by itself.
    assert stack.supervise_once() == []
    assert not stack.is_running("catalog")
    stack.start_service("catalog")
    assert stack.pid("catalog") != old and alive(stack.pid("catalog"))
    assert readyz(stack, "catalog") == 200


def test_supervision_restarts_a_crashed_service(stack: Stack) -> None:
    old = stack.pid("metering")
    assert old is not None
    os.killpg(old, signal.SIGKILL)  # behind the stack's back, like a crash
    deadline = time.monotonic() + 10
    while stack.is_running("metering") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.supervise_once() == ["metering"]
    stack.wait_ready(["metering"], timeout=120)
    assert stack.pid("metering") != old
    assert readyz(stack, "metering") == 200


async def test_restart_postgres_keeps_data_and_services_recover(stack: Stack) -> None:
    if stack.external_database:
        pytest.skip("the database is external")
    await stack.execute("billing", "CREATE TABLE IF NOT EXISTS devstack_probe (v text)")
    await stack.execute("billing", "INSERT INTO devstack_probe VALUES ('before-pg-restart')")
    old_pg = stack.pg.pid
    await asyncio.to_thread(stack.restart_postgres)
    assert stack.pg.pid != old_pg
    assert await stack.fetchval("billing", "SELECT count(*) FROM devstack_probe WHERE v = 'before-pg-restart'") == 1
    assert all(readyz(stack, n) == 200 for n in ALL)


async def _wait_sent_after(stack: Stack, event_id: uuid.UUID, after: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sent = await stack.fetchval(
            "billing", "SELECT extract(epoch FROM sent_at) FROM outbox WHERE event_id = $1", event_id
        )
        if sent is not None and float(sent) > after:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"outbox row {event_id} was not (re)published after {after}")


async def _on_broker(bootstrap: str, topic: str, event_id: uuid.UUID, timeout: float = 30) -> bool:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for r in records:
                    if dict(r.headers).get("event_id") == str(event_id).encode():
                        return True
        return False
    finally:
        await consumer.stop()


async def test_restart_broker_restarts_services_and_replays_the_outbox(stack: Stack) -> None:
    if stack.external_broker:
        pytest.skip("the broker is external")
    # An event that billing publishes to the current broker (gpuaas.billing.v1 has no consumers;
    # an unknown type would be skipped by any anyway).
    event_id = uuid.uuid4()
    t_insert = time.time()
    await stack.execute(
        "billing",
        "INSERT INTO outbox (event_id, topic, event_type, aggregate_id, payload) VALUES ($1, $2, $3, $4, $5)",
        event_id,
        "gpuaas.billing.v1",
        "devstack.probe.v1",
        "probe",
        b'{"type": "devstack.probe.v1"}',
    )
    await _wait_sent_after(stack, event_id, t_insert - 5)
    old_broker, old_pids = stack.tansu.pid, {n: stack.pid(n) for n in SERVICES}
    old_gateway = stack.pid(GATEWAY)

    t_restart = time.time()
    await asyncio.to_thread(stack.restart_broker)

    assert stack.tansu.pid != old_broker
    assert all(stack.pid(n) != old_pids[n] for n in SERVICES), "every service gets a new producer/consumer"
    assert stack.pid(GATEWAY) == old_gateway  # no broker in the gateway: left alone
    assert "billing" in stack.last_replay
    assert all(readyz(stack, n) == 200 for n in ALL)
    # The event the lost broker held was published again, onto the new broker.
    await _wait_sent_after(stack, event_id, t_restart)
    assert await _on_broker(stack.kafka_bootstrap, "gpuaas.billing.v1", event_id)
    assert read_json(stack.state_path)["broker"]["started_at"] == stack.tansu.started_at


def test_supervision_recovers_from_a_dead_broker(stack: Stack) -> None:
    if stack.external_broker:
        pytest.skip("the broker is external")
    assert stack.tansu is not None and stack.tansu.proc is not None
    old_broker, old_pids = stack.tansu.pid, {n: stack.pid(n) for n in SERVICES}
    stack.tansu.proc.kill()
    stack.tansu.proc.wait(10)
    actions = stack.supervise_once()  # restarts the broker and the services, waits until ready
    assert actions == ["broker"]
    assert stack.tansu.running and stack.tansu.pid != old_broker
    assert all(stack.pid(n) != old_pids[n] for n in SERVICES)
    assert all(readyz(stack, n) == 200 for n in ALL)


async def test_stop_leaves_nothing_and_a_second_start_reuses_the_data(stack: Stack, root: Path) -> None:
    await stack.execute("allocations", "CREATE TABLE IF NOT EXISTS devstack_probe (v text)")
    marker = f"kept-{uuid.uuid4()}"
    await stack.execute("allocations", "INSERT INTO devstack_probe VALUES ($1)", marker)
    pids = stack_pids(stack)
    assert len(pids) == len(ALL) + (stack.pg is not None) + (stack.tansu is not None)

    await asyncio.to_thread(stack.stop)
    assert leftover_processes(root, pids, preexisting=PREEXISTING) == []
    assert read_json(root / "stack.json")["running"] is False

    second = Stack(root=root, free_ports=True)
    try:
        await asyncio.to_thread(second.start)
        assert stack.external_database or (root / "pg" / "PG_VERSION").exists()
        assert await second.fetchval("allocations", "SELECT count(*) FROM devstack_probe WHERE v = $1", marker) == 1
        # Same secrets: the seeded login did not change.
        assert second.admin_login == stack.admin_login
        assert all(readyz(second, n) == 200 for n in ALL)
        # Same registry address: the references the catalog pinned at the first start still resolve.
        assert second.runtimes.address == stack.runtimes.address
        assert {s: p.ref for s, p in second.runtimes.pushed.items()} == {
            s: p.ref for s, p in stack.runtimes.pushed.items()
        }
        pids = stack_pids(second)
    finally:
        await asyncio.to_thread(second.stop)
    assert leftover_processes(root, pids, preexisting=PREEXISTING) == []
