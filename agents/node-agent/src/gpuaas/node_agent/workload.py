"""A launchable app's workload in its allocation's container (issue 21; container driver only).

The provision task of a launchable instance's allocation carries `workload` (a contracts `WorkloadSpec`:
command, port, health path, base path, the env variable that takes the secret) and `workload_token` (the
platform's per-instance secret, derived by allocations; it is in no event). The agent then:

- runs the workload as the container's command, as the allocation's user, in its home, after gpuaas-init
  (instead of idling); `{base_path}` and `{port}` in the command are replaced;
- publishes the workload's port on the host's address (`--publish <bind>::<port>`, a free host port):
  nothing else listens for it, and the workload refuses requests without the secret, which only the
  platform's gateway adds (`/apps/{instance_id}/`);
- reports the allocation active only once an HTTP GET of `<base_path><health_path>` (with the secret)
  answers below 400; a workload that exits or stays unhealthy fails the provision with its last log lines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping

import httpx
import pydantic

from gpuaas.contracts.events.allocations import WorkloadSpec
from gpuaas.node_agent.podman import ContainerInfo

INIT = "/usr/local/sbin/gpuaas-init"
START_TIMEOUT_S = 180.0  # JupyterLab on two busy cores takes ~5-15 s; a cold page cache more


class WorkloadFailed(Exception):
    pass


def spec_of(meta: Mapping[str, object]) -> WorkloadSpec | None:
    """The workload of an allocation's meta (written from its provision task's `WorkloadSpec`), or None."""
    raw = meta.get("workload") or None
    if raw is None:
        return None
    try:
        return WorkloadSpec.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise WorkloadFailed(f"the allocation's workload is malformed: {exc}") from exc


def container_args(spec: WorkloadSpec, token: str, bind: str, user: str) -> list[str]:
    """podman run options for the workload: the published port and its environment."""
    env = {
        **spec.env,
        "HOME": f"/home/{user}",
        "USER": user,
        "GPUAAS_BASE_PATH": spec.base_path,
        "GPUAAS_WORKLOAD_PORT": str(spec.port),
    }
    if spec.auth_env:
        env[spec.auth_env] = token
    args = ["--publish", f"{bind}::{spec.port}"]
    for k, v in env.items():
        args += ["--env", f"{k}={v}"]
    return args


def command(spec: WorkloadSpec, user: str, uid: int) -> list[str]:
    """The container's command: create the user (gpuaas-init), then exec the workload as that user."""
    argv = [a.replace("{base_path}", spec.base_path).replace("{port}", str(spec.port)) for a in spec.command]
    if not argv:
        raise WorkloadFailed("the workload names no command")
    script = f'u="$0"; {INIT} "$u" "$1" && shift && cd "/home/$u" && exec runuser -u "$u" -- "$@"'
    return ["/bin/sh", "-c", script, user, str(uid), *argv]


def auth_headers(spec: WorkloadSpec, token: str) -> dict[str, str]:
    if not spec.auth_env:
        return {}
    scheme = spec.auth_scheme or "token"
    return {spec.auth_header or "Authorization": f"{scheme} {token}".strip()}


def health_url(spec: WorkloadSpec, host: str, port: int) -> str:
    path = spec.base_path.rstrip("/") + "/" + (spec.health_path or "/").lstrip("/")
    return f"http://{host}:{port}{path}"


def published_port(info: ContainerInfo, spec: WorkloadSpec) -> int | None:
    ports = (info.get("NetworkSettings") or {}).get("Ports") or {}
    for binding in ports.get(f"{spec.port}/tcp") or []:
        if host_port := binding.get("HostPort"):
            return int(host_port)
    return None


async def wait_healthy(
    url: str,
    headers: dict[str, str],
    running: Callable[[], Awaitable[bool]],
    logs: Callable[[], Awaitable[str]],
    timeout_s: float = START_TIMEOUT_S,
) -> float:
    """Poll the health URL until it answers < 400; `running()` (async) False or the deadline fails it.
    Returns the seconds it took."""
    t0 = time.monotonic()
    last = "no answer yet"
    async with httpx.AsyncClient(timeout=3.0, trust_env=False, follow_redirects=False) as client:
        while True:
            try:
                r = await client.get(url, headers=headers)
                if r.status_code < 400:
                    return time.monotonic() - t0
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            if not await running():
                raise WorkloadFailed(f"the workload exited before its health check answered: {await logs()}")
            if time.monotonic() - t0 > timeout_s:
                raise WorkloadFailed(
                    f"the workload's health check {url} did not answer within {timeout_s:.0f}s ({last}): {await logs()}"
                )
            await asyncio.sleep(0.5)
