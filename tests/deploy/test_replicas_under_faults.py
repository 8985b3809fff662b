"""Issue 15, "replicas are correct", on the compose deployment (two replicas of every service and of the gateway,
three Kafka brokers): the fault suite's saga (tests/faults/workload.py: tenant, price, host + agent, allocations
created until the host is full, active, released, metered, rated) runs through `lb` and the gateway while

(a) the relay-leading replica of every service and one gateway are SIGKILLed mid-flow and stay down: the other
    replica takes over the relay lock, the consumer partitions and the background loops;
(b) one Kafka broker is SIGKILLed under load and started again: no service restarts, nothing is lost or applied
    twice;
(c) every service and gateway replica is restarted in turn (a rolling restart) while allocations are created
    and released: no request fails beyond what a retry with its Idempotency-Key recovers (`call` retries only
    502/503/504 and dropped connections, never a 500).

After each, `check_invariants` (the fault suite's: every saga complete, no GPU booked twice, one closed meter and
one final usage record per allocation, every usage record charged once, the ledger balanced, identity's audit
record once, no dead letters) and the loops' own: no usage window recorded twice, one provision and one release
task per allocation. Each test prints a line of figures (run with -s).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from tests.faults.workload import Saga, check_invariants

from .deployment import BROKERS, REPLICAS, SERVICES, Deployment, container, podman

# Minutes each on a loaded 2-core machine: above pyproject's 300 s default even without `--timeout`.
pytestmark = [pytest.mark.deploy, pytest.mark.e2e, pytest.mark.timeout(1500)]

COMPONENTS = (*SERVICES, "gateway")


async def loop_invariants(d: Deployment, saga: Saga) -> dict[str, Any]:
    """What the replicas' loops and relays could double: usage windows (metering's window closer), agent tasks
    (allocations' reconciler requeues leases), charges (billing; also in check_invariants)."""
    ids = [uuid.UUID(a) for a in saga.allocations]
    doubled = await d.fetch(
        "metering",
        "SELECT allocation_id, window_start, count(*) AS n FROM usage_records WHERE allocation_id = ANY($1) "
        "GROUP BY 1, 2 HAVING count(*) > 1",
        ids,
    )
    assert not doubled, f"usage windows recorded twice: {[dict(r) for r in doubled]}"
    tasks = await d.fetch(
        "allocations",
        "SELECT allocation_id, kind, count(*) AS n FROM agent_tasks WHERE allocation_id = ANY($1) "
        "AND kind IN ('provision', 'release') GROUP BY 1, 2",
        ids,
    )
    per_kind = {(r["allocation_id"], r["kind"]): r["n"] for r in tasks}
    for aid in ids:
        for kind in ("provision", "release"):
            assert per_kind.get((aid, kind)) == 1, f"{aid}: {per_kind.get((aid, kind))} {kind} tasks"
    charged_twice = await d.fetch(
        "billing",
        "SELECT usage_record_id FROM charges WHERE allocation_id = ANY($1) GROUP BY 1 HAVING count(*) > 1",
        ids,
    )
    assert not charged_twice, charged_twice
    return {
        "usage_windows": await d.fetchval(
            "metering", "SELECT count(*) FROM usage_records WHERE allocation_id = ANY($1)", ids
        )
    }


async def restore(d: Deployment, names: list[str], *, platform: bool = True) -> None:
    """Leave the deployment whole for the next test: start what is down, and wait until the platform's containers
    are ready (`platform`; the brokers' image has no readiness command: running is what can be checked)."""
    for name in names:
        if not await asyncio.to_thread(d.running, name):
            await asyncio.to_thread(d.start, name)
    for name in names:
        if platform:
            await d.wait_ready(name)
        else:
            assert await asyncio.to_thread(d.running, name), f"{name} did not start again"


def started_at(names: list[str]) -> dict[str, str]:
    return {n: podman("inspect", "--format", "{{.State.StartedAt}}", n) for n in names}


async def test_a_replica_of_every_service_killed_mid_flow(deployment: Deployment, saga: Saga) -> None:
    d = deployment
    leaders_before = {svc: await d.relay_leader(svc) for svc in SERVICES}
    # Kill the replica that leads the relay (else `a`): the failover under test is the relay's as well as the
    # consumer group's and the loops'.
    victims = {svc: leaders_before[svc] or "a" for svc in SERVICES}
    victims["gateway"] = "a"
    killed = [container(c, r) for c, r in victims.items()]
    t0 = time.monotonic()
    try:
        creating = asyncio.create_task(saga.create_until_full())
        await saga.wait_first_placed()
        for name in killed:  # all at once, mid-flow: creates and provision tasks in flight
            await asyncio.to_thread(d.kill, name)
        await creating
        await saga.wait_all("active", timeout_s=240)
        await saga.release_all()
        await saga.wait_all("released", timeout_s=240)
        figures = await check_invariants(saga, timeout_s=180)
        figures |= await loop_invariants(d, saga)
        assert not any(d.running(n) for n in killed), "the victims stayed down"
        leaders_after = {svc: await d.relay_leader(svc) for svc in SERVICES}
        for svc in SERVICES:
            survivor = next(r for r in REPLICAS if r != victims[svc])
            assert leaders_after[svc] == survivor, f"{svc}: relay led by {leaders_after[svc]}, not {survivor}"
        figures["seconds"] = round(time.monotonic() - t0, 1)
        figures["relay_leaders_before"] = leaders_before
    finally:
        await restore(d, killed)
    print(f"\nDEPLOY FAULT one replica of each killed ({', '.join(killed)}): {figures}")


async def test_a_kafka_broker_killed_under_load_and_restarted(deployment: Deployment, saga: Saga) -> None:
    d = deployment
    broker = container("kafka-2")
    services = [container(c, r) for c in COMPONENTS for r in REPLICAS]
    before = started_at(services)
    t0 = time.monotonic()
    try:
        creating = asyncio.create_task(saga.create_until_full())
        await saga.wait_first_placed()
        await asyncio.to_thread(d.kill, broker)
        await creating
        await saga.wait_all("active", timeout_s=240)
        releasing = asyncio.create_task(saga.release_all())
        await asyncio.sleep(5)  # the releases' events go out while the broker is still away
        await asyncio.to_thread(d.start, broker)
        await releasing
        await saga.wait_all("released", timeout_s=240)
        figures = await check_invariants(saga, timeout_s=180)
        figures |= await loop_invariants(d, saga)
        assert started_at(services) == before, "a service container restarted: the replicas should ride it out"
        figures["seconds"] = round(time.monotonic() - t0, 1)
    finally:
        await restore(d, [container(b) for b in BROKERS], platform=False)
    print(f"\nDEPLOY FAULT {broker} SIGKILL under load, then started: {figures}")


async def test_rolling_restart_of_every_service_while_allocations_are_created(
    deployment: Deployment, saga: Saga
) -> None:
    d = deployment
    restarted: dict[str, float] = {}
    done = asyncio.Event()

    async def roll() -> None:
        try:
            for component in COMPONENTS:
                for replica in REPLICAS:
                    name = container(component, replica)
                    t = time.monotonic()
                    await asyncio.to_thread(d.restart, name)
                    await d.wait_ready(name)
                    restarted[name] = round(time.monotonic() - t, 1)
        finally:
            done.set()

    cycles = 0
    t0 = time.monotonic()
    rolling = asyncio.create_task(roll())
    try:
        while not done.is_set() or cycles == 0:
            await saga.full_cycle()  # raises on any request a retry with its Idempotency-Key did not recover
            cycles += 1
        await rolling
    finally:
        if not rolling.done():
            rolling.cancel()
        await restore(d, [container(c, r) for c in COMPONENTS for r in REPLICAS])
    assert len(restarted) == len(COMPONENTS) * len(REPLICAS)
    figures = await check_invariants(saga, timeout_s=180)
    figures |= await loop_invariants(d, saga)
    figures |= {"cycles": cycles, "seconds": round(time.monotonic() - t0, 1), "restart_to_ready_s": restarted}
    print(f"\nDEPLOY rolling restart of {len(restarted)} containers during {cycles} saga cycles: {figures}")
