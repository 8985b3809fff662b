"""Commands in a member's allocation over SSH with the instance's access credential.

The platform installs the instance's public key on every allocation with a live member, asynchronously
(app-runtime → allocations → the host's agent), so right after a member is added SSH may refuse the key
or the endpoint may not answer yet. `connect` waits for both, with back-off, for at most `wait_s`, then
raises `AccessNotReady` (a `TemporaryError`: the loop tries the handler again later)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncssh

from gpuaas.sdk.client import Client
from gpuaas.sdk.controller.errors import TemporaryError
from gpuaas.sdk.controller.queue import Backoff
from gpuaas.sdk.transport import ApiError, Id

log = logging.getLogger("gpuaas.sdk.controller.exec")


class AccessNotReady(TemporaryError):
    """The key is not installed yet, or the endpoint does not answer, after waiting `wait_s`."""


class HostKeyMismatch(Exception):
    """The endpoint showed a host key other than the one the platform pinned for it: never retried (a retry
    would hand the credential to whoever answers)."""


class CommandFailed(Exception):
    def __init__(self, command: str, result: ExecResult) -> None:
        self.result = result
        super().__init__(f"{command!r} exited {result.exit_status}: {result.stderr.strip()[-500:]}")


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    username: str
    # The pinned host key as a known_hosts line (`endpoint_of` fills it from the platform); None: not verified
    # (an endpoint of your own, a test).
    known_hosts: str | None = None


@dataclass(frozen=True)
class ExecResult:
    stdout: str
    stderr: str
    exit_status: int

    @property
    def ok(self) -> bool:
        return self.exit_status == 0


async def endpoint_of(client: Client, allocation_id: Id) -> Endpoint:
    """The allocation's SSH endpoint with the host key the platform pinned for it."""
    alloc = await client.request("GET", f"/api/allocations/allocations/{allocation_id}")
    ep: dict[str, Any] = alloc.get("ssh_endpoint") or {}
    if not ep.get("host"):
        raise AccessNotReady(f"allocation {allocation_id} has no SSH endpoint yet (status {alloc.get('status')})")
    try:
        pin = await client.request("GET", f"/api/allocations/allocations/{allocation_id}/ssh-host-key")
    except ApiError as exc:
        if exc.status == 409:  # no endpoint or no pinned key yet: the host's agent has not registered one
            raise AccessNotReady(f"allocation {allocation_id}: {exc}") from exc
        raise
    return Endpoint(ep["host"], int(ep["port"]), ep["username"], known_hosts=str(pin["known_hosts"]))


async def member_address(client: Client, allocation_id: Id) -> str:
    """Where the other members reach daemons in this allocation: its address on the project network (container
    hosts give each allocation its own network namespace), else its SSH endpoint's host (process hosts)."""
    alloc = await client.request("GET", f"/api/allocations/allocations/{allocation_id}")
    net: dict[str, Any] = alloc.get("network") or {}
    ssh: dict[str, Any] = alloc.get("ssh_endpoint") or {}
    return str(net.get("address") or ssh.get("host") or "")


@asynccontextmanager
async def connect(
    endpoint: Endpoint,
    private_key: str,
    *,
    wait_s: float = 120.0,
    backoff: Backoff = Backoff(base_s=0.5, cap_s=5.0),
    on_wait: Callable[[str], Awaitable[None]] | None = None,
) -> AsyncGenerator[asyncssh.SSHClientConnection, None]:
    """An SSH connection to `endpoint` with `private_key`, retried while the key is refused or the endpoint
    is unreachable (bounded by `wait_s`). `on_wait(message)` is called now and then while waiting (e.g.
    `ctx.progress`, which also keeps the lease)."""
    key = asyncssh.import_private_key(private_key)
    known_hosts = asyncssh.import_known_hosts(endpoint.known_hosts) if endpoint.known_hosts else None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    attempt = 0
    while True:
        try:
            conn = await asyncssh.connect(
                endpoint.host,
                endpoint.port,
                username=endpoint.username,
                client_keys=[key],
                known_hosts=known_hosts,
                agent_path=None,
                config=None,
                connect_timeout=10,
            )
            break
        except asyncssh.HostKeyNotVerifiable as exc:  # (a DisconnectError: caught before the retried ones)
            raise HostKeyMismatch(
                f"{endpoint.host}:{endpoint.port} does not show the host key pinned for it: {exc.reason}"
            ) from exc
        except (asyncssh.PermissionDenied, asyncssh.DisconnectError, OSError) as exc:
            if loop.time() >= deadline:
                raise AccessNotReady(
                    f"no SSH access to {endpoint.username}@{endpoint.host}:{endpoint.port} after {wait_s:.0f}s: {exc}"
                ) from exc
            if on_wait is not None and attempt % 4 == 0:
                await on_wait(f"waiting for SSH access to {endpoint.host}:{endpoint.port} ({exc.__class__.__name__})")
            log.debug("ssh_wait endpoint=%s:%s attempt=%d error=%s", endpoint.host, endpoint.port, attempt, exc)
            await asyncio.sleep(min(backoff.delay(attempt), max(0.0, deadline - loop.time())))
            attempt += 1
    try:
        yield conn
    finally:
        conn.close()
        await conn.wait_closed()


async def run(
    conn: asyncssh.SSHClientConnection,
    command: str,
    *,
    input: str | None = None,
    timeout_s: float = 120.0,
    check: bool = True,
) -> ExecResult:
    try:
        r = await conn.run(command, input=input, timeout=timeout_s)
    except asyncssh.TimeoutError as exc:
        raise TemporaryError(f"{command!r}: no answer within {timeout_s:.0f}s") from exc
    result = ExecResult(str(r.stdout or ""), str(r.stderr or ""), int(r.exit_status or 0))
    if check and not result.ok:
        raise CommandFailed(command, result)
    return result


class MemberShell:
    """Run commands in one allocation of an instance: `await shell.run("systemctl is-active x")`.
    Each `run` opens its own connection (members are few; connections are cheap next to what they start);
    use `async with shell.session() as conn` for many commands in a row."""

    def __init__(
        self,
        client: Client,
        instance_id: Id,
        allocation_id: Id,
        *,
        wait_s: float = 120.0,
        on_wait: Callable[[str], Awaitable[None]] | None = None,
        key_source: Callable[[], Awaitable[str]] | None = None,
    ) -> None:
        self.client = client
        self.instance_id = instance_id
        self.allocation_id = allocation_id
        self.wait_s = wait_s
        self.on_wait = on_wait
        self.key_source = key_source  # a context's cached key: one audited fetch per context, not per shell
        self._key: str | None = None

    async def _private_key(self) -> str:
        if self._key is None:  # fetched on first use, kept in memory only (never logged or written)
            if self.key_source is not None:
                self._key = await self.key_source()
            else:
                self._key = (await self.client.fetch_credential(self.instance_id)).private_key
        return self._key

    @asynccontextmanager
    async def session(self) -> AsyncGenerator[asyncssh.SSHClientConnection, None]:
        endpoint = await endpoint_of(self.client, self.allocation_id)
        async with connect(endpoint, await self._private_key(), wait_s=self.wait_s, on_wait=self.on_wait) as conn:
            yield conn

    async def run(self, command: str, **kwargs: Any) -> ExecResult:
        async with self.session() as conn:
            return await run(conn, command, **kwargs)
