"""Running the node library (node.sh) on a member allocation: over SSH with the instance credential,
or locally (tests of the scripts on this machine's real Slurm)."""

from __future__ import annotations

import asyncio
import os
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Protocol

import asyncssh

NODE_LIB = files("gpuaas.slurm_reference").joinpath("node.sh").read_text()


class NodeError(Exception):
    """An action failed on the node; the message is the node's own reason."""


@dataclass
class Endpoint:
    host: str
    port: int
    username: str


def script(cluster_id: str, action: str, **env: Any) -> str:
    assigns = "".join(f"{k}={shlex.quote(str(v))}\n" for k, v in env.items())
    # the action reads nothing from stdin (which is this script): daemons and clients get /dev/null
    return f"CLUSTER_ID={shlex.quote(cluster_id)}\n{NODE_LIB}\n{assigns}{action} </dev/null\n"


def parse(stdout: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.isupper() and key.replace("_", "").isalnum():
            out[key] = value
    return out


class Runner(Protocol):
    async def __call__(self, cluster_id: str, action: str, timeout_s: float = 120, **env: Any) -> dict[str, str]: ...


def _result(rc: int | None, stdout: str, stderr: str, action: str) -> dict[str, str]:
    values = parse(stdout)
    if rc != 0:
        reason = values.get("ERROR") or (stderr.strip().splitlines() or [f"exit {rc}"])[-1]
        raise NodeError(f"{action}: {reason}")
    return values


class SshRunner:
    """One SSH connection per call (members are few; connections are cheap next to daemon starts).
    `on_wait` is called while access is not there yet (the grant reaches the host asynchronously)."""

    def __init__(
        self,
        endpoint: Endpoint,
        private_key: str,
        *,
        connect_timeout_s: float = 90,
        on_wait: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.key = asyncssh.import_private_key(private_key)
        self.connect_timeout_s = connect_timeout_s
        self.on_wait = on_wait

    async def _connect(self) -> asyncssh.SSHClientConnection:
        ep = self.endpoint
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout_s
        attempt = 0
        while True:
            try:
                return await asyncssh.connect(
                    ep.host,
                    ep.port,
                    username=ep.username,
                    client_keys=[self.key],
                    known_hosts=None,
                    agent_path=None,
                    config=None,
                    connect_timeout=10,
                )
            except (asyncssh.PermissionDenied, asyncssh.DisconnectError, OSError) as exc:
                if loop.time() > deadline:
                    raise NodeError(
                        f"no SSH access to {ep.username}@{ep.host}:{ep.port} with the instance credential: {exc}"
                    ) from exc
                if self.on_wait and attempt % 5 == 0:
                    await self.on_wait(f"waiting for SSH access to {ep.username}@{ep.host}:{ep.port}")
                attempt += 1
                await asyncio.sleep(1)

    async def __call__(self, cluster_id: str, action: str, timeout_s: float = 120, **env: Any) -> dict[str, str]:
        async with await self._connect() as conn:
            try:
                r = await conn.run("bash -s", input=script(cluster_id, action, **env), timeout=timeout_s)
            except asyncssh.TimeoutError as exc:
                raise NodeError(f"{action}: no answer within {timeout_s:.0f}s") from exc
        return _result(r.exit_status, str(r.stdout or ""), str(r.stderr or ""), action)


class LocalRunner:
    """Runs the node library on this machine as if it were the allocation `allocation_id`."""

    def __init__(self, allocation_id: str) -> None:
        self.allocation_id = allocation_id

    async def __call__(self, cluster_id: str, action: str, timeout_s: float = 120, **env: Any) -> dict[str, str]:
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-s",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "GPUAAS_ALLOCATION_ID": self.allocation_id},
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(script(cluster_id, action, **env).encode()), timeout_s)
        except TimeoutError as exc:
            proc.kill()
            raise NodeError(f"{action}: no answer within {timeout_s:.0f}s") from exc
        return _result(proc.returncode, out.decode(), err.decode(), action)
