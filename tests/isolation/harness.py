"""What the isolation tests share: a node agent on the container driver that a test owns (enrolled on its
own host class, SIGKILLed and restarted at will), tenants acting through the gateway, SSH into their
allocations, and looks at the host from outside (podman, /proc, mounts, the agent's state dir).

Everything goes through the platform (gateway API, the allocation's published SSH endpoint); the host-side
looks are what an operator of the machine would check, never a way in for the tests' actions.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh
import httpx

from gpuaas.devstack.agents import agent_base_env, write_token_file
from gpuaas.devstack.infra import stop_process
from gpuaas.devstack.pytest_plugin import Team, new_team
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.waiting import eventually, until_answered

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = ROOT / "deploy" / "local" / "containers.conf"
PASSWORD = "isolation-horse-battery"
A = "/api/allocations"
SETTLED = ("active", "failed", "released", "release_failed")


# ------------------------------------------------------------------------------------------- the host


def podman(*args: str, timeout_s: float = 60) -> str:
    """podman on this host as the agent runs it (the project's containers.conf)."""
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    r = subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-2000:])
    return r.stdout


def containers_of(allocation_id: str) -> list[str]:
    """Every container (running or not) labelled with this allocation, by name."""
    out = podman("ps", "-a", "--filter", f"label=gpuaas.allocation={allocation_id}", "--format", "{{.Names}}")
    return [line for line in out.split() if line]


def container_pid(allocation_id: str) -> int:
    """The host pid of the allocation's container's main process."""
    return int(podman("inspect", "--format", "{{.State.Pid}}", f"gpuaas-{allocation_id}").strip())


def host_pids(marker: str) -> list[int]:
    """Host pids whose command line contains `marker` (this process and pgrep itself excluded)."""
    r = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True, check=False)
    return [int(p) for p in r.stdout.split() if int(p) != os.getpid()]


def host_uid(pid: int) -> int:
    """The real uid of a host process, as the host sees it."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for pid {pid}")


def mounts_naming(text: str) -> list[str]:
    """Mount table lines (of this host's mount namespace) that mention `text`."""
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if text in line]


def paths_naming(root: Path, text: str) -> list[Path]:
    """Files and directories under `root` whose name contains `text`."""
    return [p for p in root.rglob(f"*{text}*")] if root.exists() else []


# ------------------------------------------------------------------------------------------ the agent


@dataclass
class Agent:
    """A node agent process on the container driver, for one enrolled host (its own host class)."""

    stack: Stack
    name: str
    gpus: str
    host_id: str = ""
    host_class: str = ""
    proc: subprocess.Popen | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def state_dir(self) -> Path:
        return self.stack.root / "agents" / self.name

    @property
    def token_file(self) -> Path:
        # Beside the state dir, root-only (mode 0600), as the devstack keeps it: never in the environment.
        return self.stack.root / "agents" / f"{self.name}.node-token"

    async def enrol(self, gw: httpx.AsyncClient, host_class: str) -> Agent:
        r = await gw.post(f"{A}/hosts", json={"name": self.name, "host_class": host_class})
        assert r.status_code == 201, r.text
        body = r.json()
        self.host_id, self.host_class = body["host_id"], host_class
        self.state_dir.mkdir(parents=True, exist_ok=True)
        write_token_file(self.token_file, body["node_token"])
        return self

    def start(self) -> None:
        env = agent_base_env() | {
            "GPUAAS_AGENT_SERVER_URL": self.stack.service_url("allocations"),
            "GPUAAS_AGENT_NODE_TOKEN_FILE": str(self.token_file),
            "GPUAAS_AGENT_STATE_DIR": str(self.state_dir),
            "GPUAAS_AGENT_GPUS": self.gpus,
            "GPUAAS_AGENT_PREFER_NVIDIA_SMI": "false",
            "GPUAAS_AGENT_LONG_POLL_S": "5",
            "GPUAAS_AGENT_SSH_BIND": "127.0.0.1",
            **self.stack.runtimes.agent_env(),
            # These tests are about the container driver, whatever the stack's agents run.
            "GPUAAS_AGENT_DRIVER": "container",
            "GPUAAS_AGENT_CONTAINERS_CONF": str(CONTAINERS_CONF),
            "GPUAAS_AGENT_REGISTRY_INSECURE": "true",
            **self.extra_env,
        }
        log = open(self.stack.logs_dir / f"agent-{self.name}.log", "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuaas.node_agent"], env=env, stdout=log, stderr=log, start_new_session=True
        )

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer would: no cleanup runs."""
        assert self.proc is not None and self.proc.poll() is None, "the agent is not running"
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    async def ready(self, gw: httpx.AsyncClient, timeout_s: float = 90) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            h = (await gw.get(f"{A}/hosts/{self.host_id}")).json()
            return h if h.get("status") == "ready" else None

        return await eventually(check, timeout_s, f"host {self.name} ready", interval_s=0.5)


async def limits_class(gw: httpx.AsyncClient, name: str, **figures: Any) -> None:
    """A host class with per-GPU CPU/memory shares and a pids limit (operator)."""
    body = {"default_runtime": None, "cpus_per_gpu": None, "memory_mb_per_gpu": None, "pids_limit": 4096} | figures
    r = await gw.put(f"{A}/host-classes/{name}", json=body)
    assert r.status_code in (200, 201), r.text


# ----------------------------------------------------------------------------------------- the tenants


@dataclass
class Tenant:
    """A tenant's project admin acting through the gateway, with a personal SSH key."""

    team: Team
    client: httpx.AsyncClient
    key: asyncssh.SSHKey

    @property
    def project_id(self) -> str:
        return self.team.project_id

    async def create(self, **body: Any) -> dict[str, Any]:
        async def attempt() -> dict[str, Any] | None:  # allocations' IAM projection catches up with identity
            r = await self.client.post(f"{A}/projects/{self.project_id}/allocations", json=body)
            if r.status_code == 201:
                return r.json()
            assert r.status_code in (403, 404), r.text
            return None

        return await eventually(attempt, 60, "allocation created", interval_s=0.5)

    async def get(self, allocation_id: str) -> dict[str, Any]:
        r = await self.client.get(f"{A}/allocations/{allocation_id}")
        assert r.status_code == 200, r.text
        return r.json()

    async def wait(self, allocation_id: str, *wanted: str, timeout_s: float = 180) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            a = await self.get(allocation_id)
            if a["status"] in wanted:
                return a
            assert not (a["status"] in SETTLED and a["status"] not in wanted), (wanted, a)
            return None

        return await eventually(check, timeout_s, f"allocation {allocation_id} {wanted}", interval_s=0.5)

    async def act(self, allocation_id: str, action: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        r = await self.client.post(f"{A}/allocations/{allocation_id}/{action}", json=body or {})
        assert r.status_code in (200, 202), r.text
        return r.json()

    async def active(self, **body: Any) -> dict[str, Any]:
        created = await self.create(**body)
        return await self.wait(created["allocation_id"], "active")

    async def release(self, allocation_id: str) -> dict[str, Any]:
        await self.act(allocation_id, "release")
        return await self.wait(allocation_id, "released")

    async def timeline(self, allocation_id: str) -> list[dict[str, Any]]:
        return (await self.client.get(f"{A}/allocations/{allocation_id}/timeline")).json()


async def tenant(stack: Stack, gw: httpx.AsyncClient, prefix: str) -> Tenant:
    team = await new_team(gw, prefix, prefix.title(), "iso", "owner", "member", PASSWORD)
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as c:
        r = await c.post(
            "/api/identity/auth/token",
            data={"grant_type": "password", "username": team.admin_email, "password": PASSWORD},
        )
    assert r.status_code == 200, r.text
    client = httpx.AsyncClient(
        base_url=stack.gateway_url, timeout=60, headers={"Authorization": f"Bearer {r.json()['access_token']}"}
    )
    key = asyncssh.generate_private_key("ssh-ed25519")
    r = await client.post(f"{A}/ssh-keys", json={"name": "laptop", "public_key": key.export_public_key().decode()})
    assert r.status_code == 201, r.text
    await until_answered(client, f"{A}/projects/{team.project_id}/allocations")  # project and role reached allocations
    return Tenant(team, client, key)


# ------------------------------------------------------------------------------------- SSH into one


def connect(alloc: dict[str, Any], key: asyncssh.SSHKey) -> Any:
    """`async with connect(alloc, key) as conn`: the allocation's published SSH endpoint, the key alone."""
    ep = alloc["ssh_endpoint"]
    return asyncssh.connect(
        ep["host"], ep["port"], username=ep["username"], client_keys=[key], known_hosts=None, agent_path=None,
        config=None,
    )  # fmt: skip


async def sh(
    alloc: dict[str, Any], key: asyncssh.SSHKey, command: str, timeout_s: float = 60, stdin: str | None = None
) -> Any:
    """Run `command` in the allocation over SSH; the completed process (asyncssh's, exit status not checked)."""
    async with connect(alloc, key) as conn:
        return await conn.run(command, check=False, timeout=timeout_s, input=stdin)


async def out(alloc: dict[str, Any], key: asyncssh.SSHKey, command: str, timeout_s: float = 60) -> str:
    r = await sh(alloc, key, command, timeout_s)
    assert r.exit_status == 0, (command, r.exit_status, r.stdout, r.stderr)
    return str(r.stdout)


def marker() -> str:
    """A number no other process on the host has in its command line (`sleep <marker>`)."""
    return str(700000 + uuid.uuid4().int % 200000)


async def in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)
