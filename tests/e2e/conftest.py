"""The whole suite as separate processes (the same Stack that `make run` uses), once per test session."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from gpuaas.devstack.stack import Stack, StackConfig


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    root = Path(tempfile.mkdtemp(prefix="gpuaas-e2e-"))
    root.chmod(0o755)
    # GPUAAS_DATABASE_URL / GPUAAS_KAFKA_BOOTSTRAP (e.g. Apache Kafka) are honoured by from_env.
    s = Stack(StackConfig.from_env(root=root, free_ports=True))
    s.start()
    yield s
    s.stop()


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


async def eventually(predicate, timeout_s: float, what: str, interval_s: float = 0.1):  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    last = None
    while asyncio.get_running_loop().time() < deadline:
        last = await predicate()
        if last:
            return last
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")
