"""Bad input against the whole suite as real processes: HTTP (schemathesis, oversized bodies) and topics.

Its own stack (session scope): the generated requests create junk, and malformed events are parked in
the consumers' dead letters; neither may leak into the e2e or fault tests' stack.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from gpuaas.devstack.stack import Stack, StackConfig
from gpuaas.devstack.testing import remove_root, temp_root


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    root = temp_root("gpuaas-badinput-")
    # The tests start their own node-agents (to kill them); the stack's local demo agents are not needed.
    extra = {"agents": ()} if "agents" in StackConfig.__dataclass_fields__ else {}
    s = Stack(StackConfig.from_env(root=root, free_ports=True, **extra))
    s.start()
    yield s
    s.stop()
    if not os.environ.get("GPUAAS_KEEP_STACK"):  # keep logs and data for a post-mortem
        remove_root(root)


@pytest.fixture(scope="session")
async def admin_token(stack: Stack) -> str:
    email, password = stack.admin_login
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as client:
        r = await client.post(
            "/api/identity/auth/token", data={"grant_type": "password", "username": email, "password": password}
        )
        assert r.status_code == 200, r.text
        return r.json()["access_token"]


@pytest.fixture
async def gw(stack: Stack, admin_token: str) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {admin_token}"}
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=headers, timeout=30) as client:
        yield client


async def eventually(predicate, timeout_s: float, what: str, interval_s: float = 0.2):  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    last = None
    while asyncio.get_running_loop().time() < deadline:
        last = await predicate()
        if last:
            return last
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")
