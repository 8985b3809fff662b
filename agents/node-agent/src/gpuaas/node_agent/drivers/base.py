"""The driver interface the agent's task handlers and SSH endpoint use."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from gpuaas.contracts.agent import OverlaySpec
from gpuaas.contracts.events.allocations import GpuDevice
from gpuaas.node_agent.settings import AgentSettings
from gpuaas.node_agent.workspace import Workspace, Workspaces


class DriverError(Exception):
    """A task cannot be done; the message is the reason the control plane records."""


# The environment variable that names an SSH session's processes (Driver.session / Driver.end_session).
SESSION_MARK = "GPUAAS_SSH_SESSION"


@dataclass
class SessionCommand:
    """How the SSH endpoint starts a session: argv, its environment and cwd, and (process driver) the
    cgroup the session joins before exec so that release finds everything it started."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    cgroup_procs: Path | None = None


@dataclass
class Inventory:
    gpus: list[GpuDevice] = field(default_factory=list)
    source: str = "declared"


class Driver(ABC):
    name: ClassVar[str]
    isolates_tenants: ClassVar[bool]

    def __init__(self, settings: AgentSettings, workspaces: Workspaces, agent_id: str, state_dir: Path) -> None:
        self.s = settings
        self.workspaces = workspaces
        self.agent_id = agent_id
        self.state_dir = state_dir
        self.inventory = Inventory()

    def set_inventory(self, gpus: list[GpuDevice], source: str) -> None:
        self.inventory = Inventory(list(gpus), source)

    @abstractmethod
    async def reconcile(self) -> dict[str, Any]:
        """On agent start: remove what this agent runs but does not know, bring back what it should run."""

    @abstractmethod
    async def provision(self, ws: Workspace) -> str:
        """Start the allocation as its meta describes (idempotent); a message for the timeline."""

    @abstractmethod
    async def restart(self, ws: Workspace) -> str:
        """Stop every process of the allocation and start it again; workspace, keys and volumes kept."""

    @abstractmethod
    async def apply(self, ws: Workspace, dropped_mounts: list[str]) -> str:
        """Bring the running allocation in line with its meta after a resize or a volume change."""

    @abstractmethod
    async def release(self, ws: Workspace) -> dict[str, Any]:
        """Stop and remove everything of the allocation, verify it, and return the evidence."""

    @abstractmethod
    async def stop(self, ws: Workspace, timeout_s: float) -> None:
        """A preemption's stop before the release: SIGTERM, then SIGKILL after `timeout_s` (the release then
        removes what is left and verifies it)."""

    @abstractmethod
    async def write_notice(self, ws: Workspace, name: str, body: str) -> str:
        """Write a notice (`name`: preemption) where the allocation's processes read it; its path there."""

    async def network_info(self, ws: Workspace) -> dict[str, Any] | None:
        """Where other allocations of the project reach this one ({name, address, hostname, scope}), or None
        when the driver gives allocations no network of their own (the process driver: the host's)."""
        return None

    async def sync_overlay(self, project_id: str, segment: OverlaySpec) -> int | None:
        """Bring this host's part of the project's overlay up to date (peers, names): the number of members here
        named, None when the project has no network here (the process driver never has one)."""
        return None

    async def workload_endpoint(self, ws: Workspace) -> dict[str, Any] | None:
        """A launchable workload's published port once healthy (container driver); None without one."""
        if ws.meta.get("workload"):
            raise DriverError(f"launchable workloads need the container driver; this host runs {self.name}")
        return None

    @abstractmethod
    def session(self, ws: Workspace, command: str | None, term: str | None, mark: str = "") -> SessionCommand:
        """The command an SSH session of the allocation runs (term: the pty's TERM, None without a pty). `mark`
        goes into the session's environment as SESSION_MARK, inherited by all it starts (`end_session`)."""

    async def end_session(self, ws: Workspace, mark: str) -> None:
        """Kill what a session started where the SSH endpoint's host-side kill does not reach (the container
        driver's processes live under conmon, not under the `podman exec` client). The process driver: nothing
        more to do (its sessions are host processes)."""
        return None
