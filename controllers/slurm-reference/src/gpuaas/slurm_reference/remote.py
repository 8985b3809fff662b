"""Running the node library (node.sh) on a member allocation: over SSH with the instance credential,
or locally (tests of the scripts on this machine's real Slurm)."""

from __future__ import annotations

import asyncio
import os
import shlex
from collections.abc import Awaitable, Callable
from importlib.resources import files
from typing import Any, Protocol

import asyncssh

from gpuaas.sdk.controller import exec as sdk_exec

NODE_LIB = files("gpuaas.slurm_reference").joinpath("node.sh").read_text()
# The daemons need root. On a process host the session is the agent's user (root); on a container host it
# is the allocation's own user, who has passwordless sudo inside its container: go root there (-E keeps
# GPUAAS_ALLOCATION_ID, which names the node's directory). Without sudo, node.sh's precheck says why not.
ROOT_SHELL = 'if [ "$(id -u)" != 0 ] && sudo -n true 2>/dev/null; then exec sudo -n -E bash -s; fi; exec bash -s'


class NodeError(Exception):
    """An action failed on the node; the message is the node's own reason."""


Endpoint = sdk_exec.Endpoint  # host, port, username and the pinned host key (known_hosts)


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
        self.private_key = private_key
        self.connect_timeout_s = connect_timeout_s
        self.on_wait = on_wait

    async def __call__(self, cluster_id: str, action: str, timeout_s: float = 120, **env: Any) -> dict[str, str]:
        ep = self.endpoint
        try:  # the SDK waits, with back-off, until the key is installed and the endpoint answers
            async with sdk_exec.connect(
                ep, self.private_key, wait_s=self.connect_timeout_s, on_wait=self.on_wait
            ) as conn:
                r = await conn.run(ROOT_SHELL, input=script(cluster_id, action, **env), timeout=timeout_s)
        except sdk_exec.AccessNotReady as exc:
            raise NodeError(f"{exc} (with the instance credential)") from exc
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
