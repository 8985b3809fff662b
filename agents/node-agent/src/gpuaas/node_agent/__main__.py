"""`python -m gpuaas.node_agent`: run the agent with settings from GPUAAS_AGENT_* variables."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from gpuaas.node_agent.agent import Agent
from gpuaas.node_agent.settings import AgentSettings


async def _main() -> None:
    agent = Agent(AgentSettings())
    task = asyncio.create_task(agent.run())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    asyncio.run(_main())


if __name__ == "__main__":
    main()
