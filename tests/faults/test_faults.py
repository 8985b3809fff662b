"""Fault injection on the real stack; after each fault the saga of `workload.Saga` must complete and
`check_invariants` hold (sagas complete, ledger balanced, no double booking, nothing applied twice).

- every service and the gateway SIGKILLed in the middle of its busiest part of the saga, then restarted;
- the broker stopped and started (Apache Kafka keeps its log) and SIGKILLed (log recovery);
- the outbox relays losing the broker for a minute while the API keeps accepting work;
- Postgres restarted (fast shutdown: every connection dropped);
- the node-agent SIGKILLed in the middle of its provision tasks and of its release tasks;
- catalog SIGKILLed in the middle of its own busiest flow, artifact promotion (`catalog_workload`);
- app-runtime SIGKILLed in the middle of its own busiest flow, member operations run by a controller
  (`app_workload`).

Each test prints one line with its figures (run with -s to see them).
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import asyncpg
import httpx
import psutil
import pytest

from gpuaas.devstack.config import plain_url
from gpuaas.devstack.registry import LocalRegistry, RegistryMissing
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually

from .app_workload import AppOps, check_operations
from .catalog_workload import Promotion, check_promotions
from .workload import Saga, check_invariants

pytestmark = pytest.mark.e2e

# Where in the allocation saga each service is killed (what it does then). The saga is the busiest flow of
# identity, allocations, metering, billing and the gateway; catalog and app_runtime are also killed in
# their own busiest flows: test_sigkill_catalog_mid_promotion, test_sigkill_app_runtime_mid_member_operations.
#   identity     creates: the audit records of every create flow into its store (consumer) + token checks
#   allocations  creates: placement under row locks, provision tasks leased to the agent, outbox
#   catalog      creates: its identity projection consumer (the saga touches nothing else of it)
#   app_runtime  release: the release clearance saga (allocations waits for app-runtime's answer)
#   metering     release: closing meters and emitting final usage records
#   billing      release: rating usage into the ledger
#   gateway      creates: every request of the saga passes through it
KILL_AT = {
    "identity": "create",
    "allocations": "create",
    "catalog": "create",
    "app_runtime": "release",
    "metering": "release",
    "billing": "release",
    "gateway": "create",
}


# Allocations' own database sessions other than the asking one (a role sees its own sessions' details).
OWN_BACKENDS = "SELECT count(*) FROM pg_stat_activity WHERE usename = current_user AND pid <> pg_backend_pid()"
# A host's registrations by its agent: each commits an audit event to allocations' outbox (kept for days).
REGISTRATIONS = (
    "SELECT count(*) FROM outbox WHERE event_type = 'audit.recorded' AND aggregate_id = $1 "
    "AND convert_from(payload, 'UTF8')::jsonb #>> '{data,action}' = 'allocations.host.register'"
)


@pytest.fixture
async def saga(stack: Stack, gw: httpx.AsyncClient) -> AsyncIterator[Saga]:
    s = Saga(stack, gw)
    await s.setup()
    yield s
    await s.close()


async def run_with_fault(
    saga: Saga, at: str, fault: Callable[[], Awaitable[None]], release_while: bool = False
) -> dict:
    """The saga with `fault` injected at `at` ("create": as soon as the first allocation is placed, while the
    other creates and the provision tasks are in flight; "release": right after the release requests, or
    while they are being sent with `release_while`)."""
    t0 = time.monotonic()
    if at == "create":
        creating = asyncio.create_task(saga.create_until_full())
        await saga.wait_first_placed()
        await fault()
        await creating
        await saga.wait_all("active", timeout_s=240)
        await saga.release_all()
    else:
        await saga.create_until_full()
        await saga.wait_all("active", timeout_s=240)
        if release_while:
            releasing = asyncio.create_task(saga.release_all())
            await fault()
            await releasing
        else:
            await saga.release_all()
            await fault()
    await saga.wait_all("released", timeout_s=240)
    figures = await check_invariants(saga, timeout_s=180)
    figures["seconds"] = round(time.monotonic() - t0, 1)
    return figures


def kill_and_restart(stack: Stack, name: str, down_s: float = 2.0) -> Callable[[], Awaitable[None]]:
    async def fault() -> None:
        await asyncio.to_thread(stack.kill, name, signal.SIGKILL)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(stack.start_service, name)

    return fault


@pytest.mark.parametrize("service", list(KILL_AT))
async def test_sigkill_service_mid_saga(stack: Stack, saga: Saga, service: str) -> None:
    pid = stack.pid(service)
    figures = await run_with_fault(saga, KILL_AT[service], kill_and_restart(stack, service))
    assert stack.pid(service) != pid, "the service was really killed and restarted"
    print(f"\nFAULT sigkill {service} at {KILL_AT[service]}: {figures}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["stop", "crash"])
async def test_broker_stop_start(stack: Stack, saga: Saga, sig: int) -> None:
    if stack.kafka is None:
        pytest.skip("needs the stack's own Apache Kafka (GPUAAS_STACK_BROKER=kafka); Tansu: test_exactly_once d")
    pids = {n: stack.pid(n) for n in stack.names}
    kafka, broker_pid = stack.kafka, stack.kafka.pid
    down: list[bool] = []

    async def fault() -> None:
        await asyncio.to_thread(stack.stop_broker, sig)
        down.append(not kafka.running)
        await asyncio.sleep(3)
        await asyncio.to_thread(stack.start_broker)

    figures = await run_with_fault(saga, "create", fault)
    # The fault happened: the broker was down, and what runs now is a new broker process.
    assert down == [True], "the broker was still running after the stop"
    assert kafka.running and kafka.pid != broker_pid, "the broker was not stopped and started again"
    assert {n: stack.pid(n) for n in stack.names} == pids, "no service was restarted: they rode it out"
    print(f"\nFAULT broker {signal.Signals(sig).name} + start: {figures}")


async def test_relays_lose_the_broker_for_a_minute(stack: Stack, saga: Saga) -> None:
    if stack.kafka is None:
        pytest.skip("the stack's own Apache Kafka is needed (GPUAAS_STACK_BROKER=kafka)")
    outage_s = 60.0
    pending: dict[str, int] = {}

    async def fault() -> None:
        await asyncio.to_thread(stack.stop_broker)
        # The API keeps accepting work meanwhile: the releases commit, their events wait in the outbox.
        await asyncio.sleep(outage_s / 2)
        for svc in ("allocations",):
            pending[svc] = await stack.fetchval(svc, "SELECT count(*) FROM outbox WHERE sent_at IS NULL")
        await asyncio.sleep(outage_s / 2)
        await asyncio.to_thread(stack.start_broker)

    figures = await run_with_fault(saga, "release", fault, release_while=True)
    assert pending["allocations"] > 0, "events waited in the outbox while the broker was away"
    assert await stack.fetchval("allocations", "SELECT count(*) FROM outbox WHERE sent_at IS NULL") == 0
    print(f"\nFAULT broker away {outage_s:.0f}s (outbox held {pending}): {figures}")


async def test_postgres_restart(stack: Stack, saga: Saga) -> None:
    if stack.pg is None:
        pytest.skip("external database")
    pg = stack.pg
    pids = {n: stack.pid(n) for n in stack.names}
    seen: dict[str, object] = {}

    async def fault() -> None:
        seen["pg_pid"] = pg.pid
        seen["started"] = await stack.fetchval("allocations", "SELECT pg_postmaster_start_time()")
        # Allocations' own connections (its pool and relay lock session) that the restart must drop.
        seen["backends"] = await stack.fetchval("allocations", OWN_BACKENDS)
        held = await asyncpg.connect(plain_url(stack.database_url("allocations")))
        await asyncio.to_thread(stack.restart_postgres)
        try:
            await held.fetchval("SELECT 1")
            seen["held"] = "still open"
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            seen["held"] = type(exc).__name__
        finally:
            held.terminate()

    figures = await run_with_fault(saga, "create", fault)
    # The fault happened: a new postmaster (pid and start time), every connection of before dropped...
    assert seen["backends"], "allocations had no connection of its own to lose"
    assert pg.pid != seen["pg_pid"], "Postgres was not restarted"
    assert await stack.fetchval("allocations", "SELECT pg_postmaster_start_time()") > seen["started"]
    assert seen["held"] != "still open", "a connection opened before the restart survived it"
    # ...and the services rode it out by reconnecting (no process was restarted), connected again now.
    assert {n: stack.pid(n) for n in stack.names} == pids, "a service was restarted instead of reconnecting"
    assert await stack.fetchval("allocations", OWN_BACKENDS), "allocations did not reconnect"
    print(f"\nFAULT postgres restart (held connection: {seen['held']}, {seen['backends']} dropped): {figures}")


@pytest.mark.parametrize("at", ["create", "release"])
async def test_node_agent_killed_mid_task(stack: Stack, saga: Saga, at: str) -> None:
    assert saga.agent is not None
    agent = saga.agent

    host_id = saga.host["host_id"]
    seen: dict[str, int] = {}

    async def fault() -> None:
        assert agent.proc is not None
        seen["pid"] = agent.proc.pid
        seen["registrations"] = await stack.fetchval("allocations", REGISTRATIONS, host_id)
        await asyncio.to_thread(agent.kill, signal.SIGKILL)
        seen["exit"] = agent.proc.returncode
        await asyncio.sleep(3)
        await asyncio.to_thread(agent.start)

    figures = await run_with_fault(saga, at, fault, release_while=True)
    # The fault happened: the agent died of the SIGKILL, and a new process registered the host again.
    assert seen["exit"] == -signal.SIGKILL, f"the agent ended with {seen['exit']}, not by the SIGKILL"
    assert not psutil.pid_exists(seen["pid"]), "the killed agent's process is still there"
    assert agent.proc is not None and agent.proc.pid != seen["pid"] and agent.proc.poll() is None
    registrations = await stack.fetchval("allocations", REGISTRATIONS, host_id)
    assert registrations > seen["registrations"], "no registration of the host by the restarted agent"
    print(f"\nFAULT node-agent SIGKILL at {at}: {figures}")


@pytest.fixture(scope="module")
def registry(stack: Stack) -> Iterator[LocalRegistry]:
    try:
        reg = LocalRegistry(Path(tempfile.mkdtemp(prefix="registry-", dir=stack.root))).start()
    except RegistryMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    yield reg
    reg.stop()


async def test_sigkill_catalog_mid_promotion(stack: Stack, gw: httpx.AsyncClient, registry: LocalRegistry) -> None:
    """Catalog killed a third of the way through promoting six artifacts concurrently (register, manifest,
    lint + smoke, staged, canary, active, manifest activated): every artifact ends active, each transition is
    in catalog's history and in identity's audit store exactly once, and app-runtime's projection of the
    manifests is final with each event applied once (`catalog_workload.check_promotions`)."""
    p = Promotion(stack, gw, registry)
    await p.setup()
    pid = stack.pid("catalog")
    t0 = time.monotonic()
    promoting = asyncio.create_task(p.promote_all())
    midway = asyncio.create_task(p.midway.wait())
    await asyncio.wait([promoting, midway], return_when=asyncio.FIRST_COMPLETED)
    if promoting.done():
        promoting.result()  # a failure before the fault
        raise AssertionError("the promotions finished before the fault: nothing was in flight")
    await kill_and_restart(stack, "catalog")()
    await promoting
    figures = await check_promotions(p, timeout_s=180)
    figures["seconds"] = round(time.monotonic() - t0, 1)
    assert stack.pid("catalog") != pid, "the service was really killed and restarted"
    print(f"\nFAULT sigkill catalog mid promotion: {figures}")


async def test_sigkill_app_runtime_mid_member_operations(stack: Stack, saga: Saga) -> None:
    """App-runtime killed while a controller (the SDK's ReconcileLoop, in this process) works through member
    operations: adds and removes asked for by users, one claimed by a replica that never reports (its lease
    must expire and be taken over), a remove asked for at the moment of the kill. Every operation succeeds
    exactly once and the members and timeline agree (`app_workload.check_operations`); then the instance is
    decommissioned and the allocations released, and the saga's invariants hold too."""
    w = AppOps(saga)
    await w.setup()
    try:
        await w.deploy()
        pid = stack.pid("app_runtime")
        t0 = time.monotonic()
        ops = await w.start_batch()
        first = ops["add worker a2"]
        later = asyncio.create_task(w.remove_when_added(first, saga.allocations[2]))
        await eventually(lambda: w.succeeded(first), 120, "the first add succeeded")
        in_flight = [o for o, v in (await w.operations()).items() if o in w.requested and v["status"] != "succeeded"]
        assert in_flight, "every operation finished before the fault"
        await kill_and_restart(stack, "app_runtime")()
        await later
        await w.wait_all_succeeded()
        figures = await check_operations(w, timeout_s=180)
        figures["seconds"] = round(time.monotonic() - t0, 1)
        assert stack.pid("app_runtime") != pid, "the service was really killed and restarted"
        await w.decommission()
    finally:
        await w.close()
    await saga.release_all()
    await saga.wait_all("released", timeout_s=240)
    figures["saga"] = await check_invariants(saga, timeout_s=180)
    print(f"\nFAULT sigkill app_runtime mid member operations: {figures}")
