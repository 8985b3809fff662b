"""gpuaas.kit.loops: the one shape of every background loop (reconcilers, window closers)."""

from __future__ import annotations

import asyncio
from typing import Literal

import structlog

from gpuaas.kit.loops import run_periodically, wait_or_stop

from .runtime_stub import bare_kit

# A loop that waits this long between rounds would hang the test if it ever waited when it should not.
FOREVER_S = 3600.0


class ObservedStop(asyncio.Event):
    """The kit's `stopping` event that also tells when a loop starts waiting on it (its interval wait): the
    point after which the loop cannot step again until the interval ends or stopping is set."""

    def __init__(self) -> None:
        super().__init__()
        self.waited_on = asyncio.Event()

    async def wait(self) -> Literal[True]:
        self.waited_on.set()
        return await super().wait()


async def test_stopping_ends_the_loop_at_its_wait_not_mid_step() -> None:
    kit = bare_kit()
    calls = 0
    step_done = asyncio.Event()

    async def step() -> bool:
        nonlocal calls
        calls += 1
        kit.stopping.set()  # shutdown arrives while the step runs: the step still finishes
        await asyncio.sleep(0)
        step_done.set()
        return False

    await asyncio.wait_for(run_periodically(kit, "closer", FOREVER_S, step), 5)
    assert calls == 1 and step_done.is_set()


async def test_stopping_wakes_a_loop_waiting_out_its_interval() -> None:
    kit = bare_kit()
    kit.stopping = stopping = ObservedStop()
    calls = 0

    async def step() -> None:
        nonlocal calls
        calls += 1

    loop = asyncio.create_task(run_periodically(kit, "reconciler", FOREVER_S, step))
    await asyncio.wait_for(stopping.waited_on.wait(), 5)
    assert calls == 1 and not loop.done()  # one round, then waiting out the interval
    kit.stopping.set()
    await asyncio.wait_for(loop, 5)
    assert calls == 1


async def test_a_loop_started_after_shutdown_never_steps() -> None:
    kit = bare_kit()
    kit.stopping.set()

    async def step() -> bool:
        raise AssertionError("must not run")

    await asyncio.wait_for(run_periodically(kit, "reconciler", FOREVER_S, step), 5)


async def test_a_failing_round_is_logged_and_the_next_one_runs() -> None:
    kit = bare_kit()
    calls = 0

    async def step() -> bool:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise ConnectionError("database away")
        kit.stopping.set()
        return False

    with structlog.testing.capture_logs() as logs:
        await asyncio.wait_for(run_periodically(kit, "closer", 0.01, step), 5)
    assert calls == 3
    failed = [e for e in logs if e["event"] == "closer_failed"]
    assert len(failed) == 2 and failed[0]["error"] == "ConnectionError: database away"
    assert failed[0]["log_level"] == "warning"


async def test_true_means_more_work_is_due_at_once() -> None:
    kit = bare_kit()
    kit.stopping = stopping = ObservedStop()
    results = [True, True, True, False]
    calls = 0

    async def step() -> bool:
        nonlocal calls
        calls += 1
        return results[calls - 1]

    loop = asyncio.create_task(run_periodically(kit, "batcher", FOREVER_S, step))
    # Three full batches follow each other without the interval; the fourth (not full) waits.
    await asyncio.wait_for(stopping.waited_on.wait(), 5)
    assert calls == 4 and not loop.done()
    kit.stopping.set()
    await asyncio.wait_for(loop, 5)
    assert calls == 4


async def test_a_busy_loop_still_lets_the_service_run() -> None:
    kit = bare_kit()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while not kit.stopping.is_set():
            ticks += 1
            await asyncio.sleep(0)

    async def step() -> bool:
        if ticks >= 3:
            kit.stopping.set()
        return True  # always "more": the loop must still yield between rounds

    other = asyncio.create_task(ticker())
    await asyncio.wait_for(run_periodically(kit, "batcher", FOREVER_S, step), 5)
    await other
    assert ticks >= 3


async def test_wait_or_stop_says_whether_it_was_woken_by_stopping() -> None:
    stopping = asyncio.Event()
    assert await wait_or_stop(stopping, 0.01) is False
    asyncio.get_running_loop().call_later(0.05, stopping.set)
    assert await asyncio.wait_for(wait_or_stop(stopping, FOREVER_S), 5) is True
    assert await wait_or_stop(stopping, FOREVER_S) is True  # already set: at once
