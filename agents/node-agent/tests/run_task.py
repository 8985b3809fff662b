"""Run one agent task in a process of its own (the crash tests SIGKILL it part-way):
`python run_task.py <settings.json> <task.json>`."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from gpuaas.contracts.agent import TaskLease
from gpuaas.node_agent.agent import Agent
from gpuaas.node_agent.gpus import discover
from gpuaas.node_agent.settings import AgentSettings


async def main(settings_file: Path, task_file: Path) -> None:
    settings = AgentSettings(**json.loads(settings_file.read_text()))
    agent = Agent(settings)
    agent.driver.set_inventory(*discover("", settings.gpus, False))
    lease = TaskLease.model_validate_json(task_file.read_text())
    result = await agent.execute(lease)
    print(result.model_dump_json(exclude_unset=True), flush=True)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2])))
