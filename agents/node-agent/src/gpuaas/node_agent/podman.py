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
from typing import TypedDict, cast

log = logging.getLogger("gpuaas.node_agent.podman")


class PodmanError(RuntimeError):
    pass


# What the agent reads of podman's JSON (podman 4.x). Every key is optional (total=False) and read with
# `.get`: podman versions and storage drivers differ in what they fill in, and null is common.


class ImageInfo(TypedDict, total=False):
    """`podman image inspect`, one entry."""

    Digest: str
    RepoDigests: list[str] | None


class ContainerState(TypedDict, total=False):
    Running: bool
    Pid: int


class ContainerConfig(TypedDict, total=False):
    Labels: dict[str, str] | None


class IDMappings(TypedDict, total=False):
    UidMap: list[str] | None
    GidMap: list[str] | None


class HostConfig(TypedDict, total=False):
    IDMappings: IDMappings


class GraphDriver(TypedDict, total=False):
    Name: str
    Data: dict[str, str] | None  # overlay: MergedDir, UpperDir, ...


class PortBinding(TypedDict, total=False):
    HostIp: str
    HostPort: str


class NetworkEndpoint(TypedDict, total=False):
    IPAddress: str


class NetworkSettings(TypedDict, total=False):
    Ports: dict[str, list[PortBinding] | None] | None  # "8888/tcp" -> bindings
    Networks: dict[str, NetworkEndpoint] | None


class ContainerInfo(TypedDict, total=False):
    """`podman container inspect`, one entry."""

    Id: str
    State: ContainerState
    Config: ContainerConfig
    HostConfig: HostConfig
    GraphDriver: GraphDriver
    NetworkSettings: NetworkSettings
    HostsPath: str  # the /etc/hosts podman bind-mounts into the container


class ContainerSummary(TypedDict, total=False):
    """`podman ps --format json`, one entry."""

    Id: str
    Names: list[str] | None
    Labels: dict[str, str] | None


class NetworkInfo(TypedDict, total=False):
    """`podman network inspect`, one entry."""

    name: str
    network_interface: str
    dns_enabled: bool
    options: dict[str, str] | None
    labels: dict[str, str] | None
    subnets: list[dict[str, str]] | None  # [{subnet, gateway}]


def json_objects(out: str) -> list[dict[str, object]]:
    """podman's JSON output that is a list of objects (inspect, ps); empty output or null is `[]`."""
    data: object = json.loads(out or "[]")
    if data is None:
        return []
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in cast("list[object]", data)):
        raise PodmanError(f"podman answered {out[:200]!r} where a JSON list of objects was expected")
    return cast("list[dict[str, object]]", data)


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
        info = cast("ImageInfo", (json_objects(out) or [{}])[0])  # checked objects; keys read with .get
        return {info.get("Digest") or ""} | {d.rsplit("@", 1)[-1] for d in info.get("RepoDigests") or []}

    async def pull(self, ref: str) -> None:
        await self.run("pull", "-q", f"--tls-verify={'true' if self.tls_verify else 'false'}", ref, timeout_s=1800)

    # --------------------------------------------------------------------------------- containers

    async def inspect(self, name: str) -> ContainerInfo | None:
        rc, out, _ = await self.run("container", "inspect", name, check=False)
        if rc != 0:
            return None
        data = json_objects(out)
        return cast("ContainerInfo", data[0]) if data else None  # checked objects; keys read with .get

    async def exists(self, name: str) -> bool:
        rc, _, _ = await self.run("container", "exists", name, check=False)
        return rc == 0

    async def containers(self, label: str) -> list[ContainerSummary]:
        _, out, _ = await self.run("ps", "-a", "--filter", f"label={label}", "--format", "json")
        return cast("list[ContainerSummary]", json_objects(out))  # checked objects; keys read with .get

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
