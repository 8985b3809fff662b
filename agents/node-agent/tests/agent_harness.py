"""Helpers for the node agent's driver tests: real podman, a real registry, real SSH.

`Host` is a real `Agent` (its task handlers, drivers and asyncssh endpoint) driven task by task
without a control plane: progress reports go to an address where nothing listens and are dropped,
as the agent does whenever the service is unreachable. The runtime image is engineer A's
`gpuaas-base` (Debian 12 built by mmdebstrap, cached), pushed to a `LocalRegistry` started for the
session and pulled by digest by the agent.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from gpuaas.contracts.agent import TaskLease
from gpuaas.node_agent.agent import Agent
from gpuaas.node_agent.settings import AgentSettings

REPO = Path(__file__).resolve().parents[3]
CONTAINERS_CONF = REPO / "deploy" / "local" / "containers.conf"
PODMAN_ENV = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}

needs_podman = pytest.mark.skipif(shutil.which("podman") is None, reason="podman is not installed")


def podman(*args: str, check: bool = True) -> str:
    return subprocess.run(
        ["podman", *args], env=PODMAN_ENV, capture_output=True, text=True, check=check, timeout=600
    ).stdout


def write_token(path: Path, mode: int = 0o600) -> Path:
    path.write_text("node-token-for-tests\n")
    os.chmod(path, mode)
    return path


def agent_settings(state_dir: Path, driver: str, **overrides: Any) -> AgentSettings:
    state_dir.mkdir(parents=True, exist_ok=True)
    token = write_token(state_dir.parent / f"{state_dir.name}.token")
    values: dict[str, Any] = {
        "server_url": "http://127.0.0.1:9",  # no control plane: progress reports are dropped
        "node_token_file": token,
        "state_dir": state_dir,
        "gpus": "4xH100-80GB",
        "prefer_nvidia_smi": False,
        "driver": driver,
        "containers_conf": str(CONTAINERS_CONF),
        "registry_insecure": True,
        **overrides,
    }
    return AgentSettings(**values)


class Host:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.keys: dict[str, asyncssh.SSHKey] = {}

    @property
    def port(self) -> int:
        return self.agent.ssh_port

    def payload(
        self,
        username: str,
        gpus: list[int],
        runtime: dict[str, str] | None = None,
        limits: dict[str, Any] | None = None,
        volumes: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        key = self.keys.setdefault(username, asyncssh.generate_private_key("ssh-ed25519"))
        return {
            "allocation_id": str(uuid.uuid4()),
            "username": username,
            "gpu_indices": gpus,
            "authorized_keys": [key.export_public_key().decode().strip()],
            "volumes": volumes or [],
            "runtime": runtime,
            "limits": limits,
        }

    async def task(self, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Run one task as the agent receives it from the control plane (the lease parsed by the protocol
        contract); its result as it goes on the wire."""
        lease = TaskLease.model_validate({"task_id": str(uuid.uuid4()), "kind": kind, "payload": payload})
        result = await self.agent.execute(lease)
        return result.model_dump(mode="json", exclude_unset=True)

    async def ssh(
        self, username: str, command: str, timeout: float = 60, term_type: str | None = None
    ) -> asyncssh.SSHCompletedProcess:
        async with asyncssh.connect(
            "127.0.0.1", self.port, username=username, client_keys=[self.keys[username]], known_hosts=None
        ) as conn:
            return await asyncio.wait_for(conn.run(command, term_type=term_type), timeout)


async def start_host(settings: AgentSettings) -> Host:
    agent = Agent(settings)
    await agent.reconcile()
    agent.ssh_port = await agent.endpoint.start("127.0.0.1", 0)
    return Host(agent)


async def stop_host(host: Host) -> None:
    await host.agent.endpoint.stop()
    await host.agent.client.aclose()


def containers_of(agent: Agent) -> list[str]:
    out = podman("ps", "-a", "--filter", f"label=gpuaas.agent={agent.agent_id}", "--format", "{{.Names}}")
    return out.split()
