"""A thin asyncio wrapper around the podman CLI (rootful podman 4.x with runc).

The CLI is the stable interface on every distribution; the python bindings need the podman API
service, which this agent does not want to run. `CONTAINERS_CONF` comes from the agent's settings
(on this machine kind podman only works with runc and without its default ulimits)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import time
from typing import Any

log = logging.getLogger("gpuaas.node_agent.podman")


class PodmanError(RuntimeError):
    pass


def installed(binary: str = "podman") -> bool:
    return shutil.which(binary) is not None


class Podman:
    def __init__(self, binary: str = "podman", containers_conf: str = "", tls_verify: bool = True) -> None:
        self.binary = shutil.which(binary) or binary
        self.tls_verify = tls_verify
        self.env = dict(os.environ)
        if containers_conf:
            self.env["CONTAINERS_CONF"] = str(containers_conf)

    def argv(self, *args: str) -> list[str]:
        return [self.binary, *args]

    async def run(self, *args: str, check: bool = True, timeout_s: float = 300) -> tuple[int, str, str]:
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *self.argv(*args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise PodmanError(f"podman {args[0]} timed out after {timeout_s}s") from None
        rc = proc.returncode or 0
        log.debug("podman %s: rc %s in %.3fs", " ".join(args[:2]), rc, time.monotonic() - started)
        if check and rc != 0:
            raise PodmanError(
                f"podman {' '.join(args[:2])} failed ({rc}): {err.decode(errors='replace').strip()[-500:]}"
            )
        return rc, out.decode(errors="replace"), err.decode(errors="replace")

    # ------------------------------------------------------------------------------------- images

    async def image_digests(self, ref: str) -> set[str] | None:
        """The manifest digests podman recorded for a local image, or None when it is not here."""
        rc, out, _ = await self.run("image", "inspect", ref, check=False)
        if rc != 0:
            return None
        info = (json.loads(out) or [{}])[0]
        return {info.get("Digest") or ""} | {d.rsplit("@", 1)[-1] for d in info.get("RepoDigests") or []}

    async def pull(self, ref: str) -> None:
        await self.run("pull", "-q", f"--tls-verify={'true' if self.tls_verify else 'false'}", ref, timeout_s=1800)

    # --------------------------------------------------------------------------------- containers

    async def inspect(self, name: str) -> dict[str, Any] | None:
        rc, out, _ = await self.run("container", "inspect", name, check=False)
        if rc != 0:
            return None
        data = json.loads(out)
        return data[0] if data else None

    async def exists(self, name: str) -> bool:
        rc, _, _ = await self.run("container", "exists", name, check=False)
        return rc == 0

    async def containers(self, label: str) -> list[dict[str, Any]]:
        _, out, _ = await self.run("ps", "-a", "--filter", f"label={label}", "--format", "json")
        return json.loads(out or "[]") or []

    async def remove(self, name: str, attempts: int = 6) -> None:
        """`podman rm -f`, retried: removing the shm mount can fail with EBUSY for a moment while another
        container being created on the host holds a copy of it in its new mount namespace."""
        for attempt in range(attempts):
            try:
                await self.run("rm", "-f", "-t", "0", "--ignore", name)
                return
            except PodmanError:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.25 * 2**attempt)

    async def exec(self, name: str, *argv: str, user: str = "root") -> str:
        _, out, _ = await self.run("exec", "--user", user, name, *argv)
        return out
