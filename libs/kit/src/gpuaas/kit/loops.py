"""Background loops of a service (reconcilers, window closers): one helper so every loop honours shutdown,
survives a failed round and never spins.

    async def reconciler(kit: KitRuntime) -> None:
        await run_periodically(kit, "reconciler", settings.interval_s, lambda: reconcile_once(kit))

`step` returns True when it knows more work is due at once (a full batch): the loop goes on without
waiting. Anything it raises is logged and the next round runs after the interval (the database or broker
may be away for a while); a shutdown (`kit.stopping`) ends the loop at its next wait, never mid-step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import TYPE_CHECKING

from gpuaas.kit.logging import get_logger

if TYPE_CHECKING:
    from gpuaas.kit.app import KitRuntime

log = get_logger(__name__)


async def run_periodically(
    kit: KitRuntime,
    name: str,
    interval_s: float,
    step: Callable[[], Awaitable[bool | None]],
) -> None:
    while not kit.stopping.is_set():
        more = False
        try:
            more = bool(await step())
        except Exception as exc:
            log.warning(f"{name}_failed", error=f"{type(exc).__name__}: {exc}")
        if more:
            await asyncio.sleep(0)  # let the rest of the service run between full batches
            continue
        await wait_or_stop(kit.stopping, interval_s)


async def wait_or_stop(stopping: asyncio.Event, seconds: float) -> bool:
    """Sleep `seconds`, waking at once when `stopping` is set; True when it was."""
    with suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)
    return stopping.is_set()
