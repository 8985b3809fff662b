"""Local node-agents for the stack: GPU hosts with declared GPUs, so a new user can allocate at once.

After the services are ready, each configured agent's host is enrolled through the allocations API
as the bootstrap operator (the node token is kept in secrets.json and reused; a token the database
no longer knows is rotated through `POST /hosts/{id}/node-token`), then `python -m gpuaas.node_agent`
runs with its own state dir (<root>/agents/<name>) and log (<root>/logs/agent-<name>.log).
Each agent reads its node token from a root-only file (<root>/agents/<name>.node-token, mode 0600),
never from its environment (which an allocation's session could read). With the container driver
(`extra_env`, from runtimes.LocalRuntimes.agent_env) allocations run in podman containers from the
catalog's runtime images; with the process driver they are per-allocation workspaces on the host.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from gpuaas.devstack.credentials import Credentials
from gpuaas.devstack.infra import signal_group, stop_process
from gpuaas.devstack.runtime_images import podman_available, podman_env

log = logging.getLogger("gpuaas.devstack")
ENROL_TIMEOUT_S = 90.0


def write_token_file(path: Path, token: str) -> Path:
    """The node token in a file only its owner can read (created 0600, never world-readable meanwhile)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return path


def remove_agent_containers(agents_dir: Path) -> int:
    """Remove the allocation containers of every node agent whose state dir lies under `agents_dir` (each
    agent labels its containers `gpuaas.agent=<the id in its state dir>`): a disposable test stack must not
    leave its allocations running after its agents are gone. Returns how many were removed."""
    ids = [p.read_text().strip() for p in agents_dir.glob("*/agent_id")] if agents_dir.is_dir() else []
    if not ids or not podman_available():
        return 0
    removed = 0
    for agent_id in ids:
        listed = subprocess.run(
            ["podman", "ps", "-aq", "--filter", f"label=gpuaas.agent={agent_id}"],
            env=podman_env(),
            capture_output=True,
            text=True,
            check=False,
        )
        names = listed.stdout.split()
        if names:
            subprocess.run(
                ["podman", "rm", "-f", "-t", "0", *names], env=podman_env(), capture_output=True, check=False
            )
            removed += len(names)
    if removed:  # their project networks too (the agents are gone: nobody else would remove them)
        prune = [sys.executable, "-m", "gpuaas.node_agent.project_network", "prune"]
        subprocess.run(prune, env=podman_env(), capture_output=True, check=False, timeout=120)
    return removed


def agent_base_env() -> dict[str, str]:
    """The runner's environment less any node token it carries (an agent gets only its own, from a file)."""
    return {k: v for k, v in os.environ.items() if k not in ("GPUAAS_AGENT_NODE_TOKEN", "GPUAAS_AGENT_NODE_TOKEN_FILE")}


class LocalAgents:
    def __init__(
        self,
        configured: Sequence[tuple[str, str]],
        root: Path,
        logs_dir: Path,
        host: str,
        python: str,
        credentials: Credentials,
        service_url: Callable[[str], str],
        extra_env: Callable[[], dict[str, str]] = dict,
    ) -> None:
        self.configured = list(configured)  # (name, declared GPUs)
        self.root = root
        self.logs_dir = logs_dir
        self.host = host
        self.python = python
        self.credentials = credentials
        self.service_url = service_url
        self.extra_env = extra_env  # e.g. the runtime driver, read at each (re)start
        self.procs: dict[str, subprocess.Popen] = {}
        self.wanted: set[str] = set()

    # ------------------------------------------------------------------------------------ enrolment

    def _operator(self) -> httpx.Client:
        email, password = self.credentials.admin_login
        identity = self.service_url("identity")
        r = httpx.post(
            f"{identity}/auth/token",
            data={"grant_type": "password", "username": email, "password": password},
            timeout=30,
        )
        r.raise_for_status()
        token = r.json()["access_token"]
        return httpx.Client(
            base_url=self.service_url("allocations"), timeout=30, headers={"Authorization": f"Bearer {token}"}
        )

    def _token_works(self, token: str) -> bool:
        r = httpx.post(
            f"{self.service_url('allocations')}/agent/heartbeat",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )
        return r.status_code == 200

    def _enrol(self, name: str) -> str:
        """A valid node token for host `name`: stored, freshly enrolled, or rotated."""
        stored = self.credentials.agent_token(name)
        if stored and self._token_works(stored):
            return stored
        deadline = time.monotonic() + ENROL_TIMEOUT_S
        while True:
            try:
                with self._operator() as op:
                    r = op.post("/hosts", json={"name": name, "labels": {"source": "devstack"}})
                    if r.status_code == 409:  # enrolled before, token lost: rotate it
                        host = next(h for h in op.get("/hosts").json() if h["name"] == name)
                        r = op.post(f"/hosts/{host['host_id']}/node-token")
                    if r.status_code in (200, 201):
                        token = str(r.json()["node_token"])
                        self.credentials.set_agent_token(name, token)
                        return token
                    # 401/403/404 while allocations' IAM projection has not seen the operator yet
                    last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not enrol host {name}: {last}")
            time.sleep(1.0)

    # ------------------------------------------------------------------------------------ processes

    def _spawn(self, name: str, gpus: str, token: str) -> None:
        state = self.root / "agents" / name
        state.mkdir(parents=True, exist_ok=True)
        env = {
            **agent_base_env(),
            "GPUAAS_AGENT_SERVER_URL": self.service_url("allocations"),
            "GPUAAS_AGENT_NODE_TOKEN_FILE": str(write_token_file(self.root / "agents" / f"{name}.node-token", token)),
            "GPUAAS_AGENT_STATE_DIR": str(state),
            "GPUAAS_AGENT_GPUS": gpus,
            "GPUAAS_AGENT_PREFER_NVIDIA_SMI": "false",
            "GPUAAS_AGENT_SSH_BIND": self.host,
            **self.extra_env(),
        }
        with open(self.logs_dir / f"agent-{name}.log", "ab") as logf:
            self.procs[name] = subprocess.Popen(
                [self.python, "-m", "gpuaas.node_agent"],
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.wanted.add(name)
        log.info(
            "started agent %s (pid %s, GPUs %s, %s driver)",
            name,
            self.procs[name].pid,
            gpus,
            env.get("GPUAAS_AGENT_DRIVER", "default"),
        )

    def start(self) -> None:
        for name, gpus in self.configured:
            try:
                self._spawn(name, gpus, self._enrol(name))
            except (RuntimeError, httpx.HTTPError) as exc:
                log.error("agent %s not started: %s", name, exc)
        self.wait_registered()

    def wait_registered(self, timeout_s: float = 60.0) -> None:
        names = [n for n in self.procs if self.procs[n].poll() is None]
        if not names:
            return
        deadline = time.monotonic() + timeout_s
        pending = set(names)
        while pending and time.monotonic() < deadline:
            try:
                with self._operator() as op:
                    hosts = {h["name"]: h["status"] for h in op.get("/hosts").json()}
                pending = {n for n in pending if hosts.get(n) not in ("ready", "cordoned")}
            except (httpx.HTTPError, ValueError):
                pass
            if pending:
                time.sleep(0.5)
        if pending:
            log.warning("agents not registered yet: %s (see logs/agent-<name>.log)", ", ".join(sorted(pending)))

    def supervise(self) -> list[str]:
        restarted = []
        for name, gpus in self.configured:
            p = self.procs.get(name)
            token = self.credentials.agent_token(name)
            if name in self.wanted and p is not None and p.poll() is not None and token:
                log.warning("agent %s exited (code %s); restarting it", name, p.returncode)
                self._spawn(name, gpus, token)
                restarted.append(f"agent-{name}")
        return restarted

    def stop(self, timeout_s: float = 10.0) -> None:
        self.wanted.clear()
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            signal_group(p, signal.SIGTERM)
        for p in live:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                stop_process(p, signal.SIGKILL)
        self.procs.clear()

    def state(self) -> dict[str, Any]:
        return {
            name: {
                "pid": p.pid if p.poll() is None else None,
                "state_dir": str(self.root / "agents" / name),
                "log": str(self.logs_dir / f"agent-{name}.log"),
            }
            for name, p in self.procs.items()
        }
