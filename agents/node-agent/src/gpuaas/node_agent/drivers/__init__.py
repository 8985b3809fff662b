"""Runtime drivers: how an allocation's processes run on this host.

- `container` (drivers/container.py): one podman container per allocation from a runtime image
  pinned by digest; isolates tenants (own user namespace, PID namespace, cgroup limits, network).
- `process` (drivers/process.py): sessions run on the host as the agent's user in a per-allocation
  workspace and cgroup; does NOT isolate tenants (placement keeps one tenant per such host).
"""

from __future__ import annotations

from pathlib import Path

from gpuaas.node_agent import podman
from gpuaas.node_agent.drivers.base import Driver, DriverError, SessionCommand
from gpuaas.node_agent.settings import AgentSettings
from gpuaas.node_agent.workspace import Workspaces

__all__ = ["Driver", "DriverError", "SessionCommand", "choose"]


def choose(settings: AgentSettings, workspaces: Workspaces, agent_id: str, state_dir: Path) -> Driver:
    name = settings.driver
    if name == "auto":
        name = "container" if podman.installed(settings.podman) else "process"
    if name == "container":
        from gpuaas.node_agent.drivers.container import ContainerDriver

        return ContainerDriver(settings, workspaces, agent_id, state_dir)
    from gpuaas.node_agent.drivers.process import ProcessDriver

    return ProcessDriver(settings, workspaces, agent_id, state_dir)
