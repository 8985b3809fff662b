"""The golden path's cast and tools: users acting through the SDK (each action under its own
correlation id), step timings, node agents and SSH, and the Slurm daemons a run must not leave behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncssh

from gpuaas.devstack.agents import agent_base_env, write_token_file
from gpuaas.sdk import Client

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "slurmdbd", "mariadbd", "sacctmgr")


def cannot_run_slurm(containers: bool = False) -> str | None:
    if os.geteuid() != 0:
        return "the golden path runs Slurm's daemons in allocations: it needs root"
    if containers:  # the gpuaas-slurm runtime image carries Slurm
        return None
    missing = [b for b in SLURM_BINARIES if not shutil.which(b, path="/usr/sbin:/usr/bin:/sbin:/bin")]
    if missing:
        return f"missing {' '.join(missing)}: run `make install` (Debian slurm-wlm, slurmdbd, munge, mariadb-server)"
    return None


class Steps:
    """Step timings of the run (what the closing note reports)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.current: tuple[str, float] | None = None
        self.done: list[dict[str, Any]] = []

    def start(self, name: str) -> None:
        self.finish()
        self.current = (name, time.monotonic())
        print(f"\n[golden path] {name} ...", flush=True)

    def finish(self) -> None:
        if self.current:
            name, t = self.current
            took = round(time.monotonic() - t, 1)
            self.done.append({"step": name, "seconds": took})
            print(f"[golden path] {name}: {took}s", flush=True)
            self.current = None


class Actor:
    """A logged-in user whose every action carries its own correlation id (as the web console does)."""

    def __init__(self, url: str, name: str) -> None:
        self.name = name
        self.client = Client(url, timeout_s=60)
        self.actions: list[tuple[str, str, str]] = []  # (correlation id, method, path)

    async def login(self, email: str, password: str) -> None:
        await self.client.login(email, password)

    async def act(self, method: str, path: str, **kwargs: Any) -> Any:
        cid = str(uuid.uuid4())
        out = await self.client.request(method, path, headers={"X-Correlation-ID": cid}, **kwargs)
        self.actions.append((cid, method, path))  # a refused request changed nothing and is not audited
        return out

    async def get(self, path: str, **params: Any) -> Any:
        return await self.client.request("GET", path, params=params or None)


@dataclass
class Target:
    """Where the scenario runs: a Stack has these attributes (allocations_url aside)."""

    gateway_url: str
    allocations_url: str  # node agents dial allocations directly, never through the gateway
    admin_login: tuple[str, str]
    root: Path
    logs_dir: Path
    # The node agents' runtime driver settings (a Stack's `runtimes.agent_env()`); empty: the agent's defaults.
    agent_env: dict[str, str] = field(default_factory=dict)


def start_agent(stack: Target, token: str, name: str, gpus: str, **extra: str) -> subprocess.Popen:
    """A node agent for host `name`, its node token in a 0600 file (never in its environment)."""
    state = stack.root / "agents" / name
    state.mkdir(parents=True, exist_ok=True)
    env = {
        **agent_base_env(),
        "GPUAAS_AGENT_SERVER_URL": stack.allocations_url,
        "GPUAAS_AGENT_NODE_TOKEN_FILE": str(write_token_file(stack.root / "agents" / f"{name}.node-token", token)),
        "GPUAAS_AGENT_STATE_DIR": str(state),
        "GPUAAS_AGENT_GPUS": gpus,
        "GPUAAS_AGENT_PREFER_NVIDIA_SMI": "false",
        "GPUAAS_AGENT_LONG_POLL_S": "5",
        **stack.agent_env,
        **extra,
    }
    log = open(stack.logs_dir / f"agent-{name}.log", "ab")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(
        [sys.executable, "-m", "gpuaas.node_agent"], env=env, stdout=log, stderr=log, start_new_session=True
    )


def ssh_connect(endpoint: dict[str, Any], key: asyncssh.SSHKey) -> Any:
    """`async with ssh_connect(...) as conn`: an allocation's SSH endpoint (`ssh_endpoint` of its answer)
    with `key` alone: no agent, no ssh config, no known hosts."""
    return asyncssh.connect(
        endpoint["host"],
        endpoint["port"],
        username=endpoint["username"],
        client_keys=[key],
        known_hosts=None,
        agent_path=None,
        config=None,
    )


async def ssh(endpoint: dict[str, Any], key: asyncssh.SSHKey, command: str, timeout_s: float = 120) -> str:
    async with ssh_connect(endpoint, key) as conn:
        r = await conn.run(command, timeout=timeout_s)
        assert r.exit_status == 0, (command, r.stdout, r.stderr)
        return str(r.stdout)


async def can_ssh(endpoint: dict[str, Any], key: asyncssh.SSHKey) -> bool:
    try:
        return "ok" in await ssh(endpoint, key, "echo ok", 20)
    except (asyncssh.PermissionDenied, OSError):
        return False


def cluster_processes(cid: str) -> list[int]:
    """Pids of daemons the controller started for this cluster (marked GPUAAS_SLURM_DIR=.../<cid>)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if not zombie and any(e.startswith(b"GPUAAS_SLURM_DIR=") and e.endswith(cid.encode()) for e in env):
            pids.append(int(entry))
    return pids


def reap(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def instance_operations(client: Actor, iid: str) -> list[dict[str, Any]]:
    ops = await client.get(f"/api/app-runtime/instances/{iid}/operations")
    return ops["items"] if isinstance(ops, dict) else ops


async def unaudited_actions(op: Actor, started: datetime, actions: list[tuple[str, str, str]]) -> list[str]:
    page = await op.get("/api/identity/audit", since=started.isoformat(), limit=1000)
    items = page["items"] if isinstance(page, dict) else page
    seen = {r.get("correlation_id") for r in items}
    return [f"{m} {p}" for cid, m, p in actions if cid not in seen]
