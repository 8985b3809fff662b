"""The parts of the controller toolkit that need no platform: the work queue's dedup, delays and back-off,
the typed config built from a manifest's `inputs`, handler lookup by kind and role, and the runner's
loading of `module:Controller` (everything with the platform: services/app_runtime/tests/test_sdk_controller.py,
tests/e2e/test_echo_controller.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from pydantic import ValidationError

from gpuaas.sdk.controller import Backoff, Controller, OperationContext, WorkQueue, config_model, on
from gpuaas.sdk.controller.runner import load_controller


async def test_queue_dedups_delays_and_backs_off() -> None:
    q = WorkQueue(backoff=Backoff(base_s=0.05, factor=2, cap_s=1, jitter=0), qps=1000)
    q.add("a")
    q.add("a")
    q.add_after("b", 0.2)
    assert len(q) == 2
    assert await q.get() == "a"
    q.add("a")  # while processing: queued again once done, not handed out twice
    assert len(q) == 1  # only "b"
    q.done("a")
    assert await q.get() == "a"
    q.done("a")
    started = time.monotonic()
    assert await q.get() == "b"
    assert time.monotonic() - started >= 0.15
    q.done("b")
    assert [q.add_rate_limited("c") for _ in range(4)][-1] == pytest.approx(0.4)  # 0.05·2³
    q.forget("c")
    assert q.failures("c") == 0


async def test_queue_is_rate_limited() -> None:
    q = WorkQueue(qps=20)
    for k in range(5):
        q.add(k)
    started = time.monotonic()
    for _ in range(5):
        q.done(await q.get())
    assert time.monotonic() - started >= 4 / 20 * 0.9


async def test_a_cancel_that_lands_as_a_key_arrives_still_cancels() -> None:
    """Python 3.11's wait_for swallowed a cancel that landed as the awaited event fired; the queue then
    waited again and a stopped controller hung (seen in CI)."""
    for steps in range(4):  # the cancel lands 0..3 loop steps after the key: one of them hit the race
        q: WorkQueue[str] = WorkQueue(qps=1000)
        q.add_after("later", 30)  # the getter waits with a timeout (as in CI), not forever
        task = asyncio.create_task(q.get())
        for _ in range(3):
            await asyncio.sleep(0)  # the getter is parked on the queue's event
        q.add("k")
        for _ in range(steps):
            await asyncio.sleep(0)
        if task.done():
            continue  # got its key before the cancel: nothing to prove at this step count
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_config_model_from_the_manifest_inputs() -> None:
    Config = config_model(
        {
            "type": "object",
            "properties": {
                "greeting": {"type": "string"},
                "poll_every_s": {"type": "integer", "default": 2},
                "mode": {"enum": ["fast", "safe"]},
                "tags": {"type": "array", "items": {"type": "string"}},
                "gpu-type": {"type": "string"},
            },
            "required": ["greeting"],
        }
    )
    c = Config.model_validate({"greeting": "hi", "tags": ["a"], "gpu-type": "H100", "later": 1})
    assert (c.greeting, c.poll_every_s, c.mode, c.tags, c.gpu_type) == ("hi", 2, None, ["a"], "H100")
    with pytest.raises(ValidationError):
        Config.model_validate({"poll_every_s": 3})
    with pytest.raises(ValidationError):
        Config.model_validate({"greeting": "x", "mode": "reckless"})


class Routed(Controller):
    @on("add", role="server")
    async def add_server(self, ctx: OperationContext) -> dict[str, Any]:
        return {"h": "server"}

    @on("add")
    async def add_any(self, ctx: OperationContext) -> dict[str, Any]:
        return {"h": "any"}

    @on("remove", role="worker")
    async def remove_worker(self, ctx: OperationContext) -> dict[str, Any]:
        return {"h": "remove"}


async def test_handlers_by_kind_and_role() -> None:
    c = Routed()

    async def call(kind: str, role: str | None) -> Any:
        h = c.handler_for(kind, role)
        return None if h is None else (await h(None))["h"]

    assert await call("add", "server") == "server"
    assert await call("add", "worker") == "any"
    assert await call("recover", "server") == "server"  # recover/replace fall back to add of the role
    assert await call("replace", "worker") == "any"
    assert await call("remove", "worker") == "remove"
    assert await call("remove", "server") is None
    assert await call("drain", "worker") is None
    with pytest.raises(ValueError):
        on("explode")


def test_runner_loads_module_colon_class() -> None:
    assert isinstance(load_controller(f"{__name__}:Routed"), Routed)
    with pytest.raises(SystemExit):
        load_controller(f"{__name__}")
    with pytest.raises(SystemExit):
        load_controller("asyncio:Event")


def test_legacy_reconcile_signature_is_detected() -> None:
    class Old(Controller):
        async def reconcile(self, client, instance) -> None:
            return None

    assert Old().legacy_reconcile() and not Routed().legacy_reconcile()
