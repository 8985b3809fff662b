"""The isolation suite: a whole stack as processes (the same Stack as `make run`, its registry and runtime
images), and node agents on the container driver that each test enrols on its own host class, so that
what a test does to its host (two tenants side by side, limits, SIGKILLs) is the only thing there.

Needs root, podman + runc (deploy/local/containers.conf) and the runtime images (`make runtime-images`,
built on demand by the devstack): the tests fail, naming what is missing, where these are absent."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from gpuaas.devstack.pytest_plugin import run_stack
from gpuaas.devstack.stack import Stack

from .harness import Agent, Tenant, tenant


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    if os.geteuid() != 0:
        pytest.fail("the isolation suite runs the container driver rootful: run it as root", pytrace=False)
    if shutil.which("podman") is None:
        pytest.fail("podman is needed (apt-get install podman runc; `make install` does it)", pytrace=False)
    yield from run_stack(request, "gpuaas-isolation-")


@pytest.fixture
async def host(stack: Stack, gw: httpx.AsyncClient) -> AsyncIterator[Agent]:
    """A 4-GPU container host of its own host class (no limits set: the host's share per GPU)."""
    run = uuid.uuid4().hex[:6]
    agent = await Agent(stack, f"iso-{run}", "4xH100-80GB").enrol(gw, f"iso-{run}")
    agent.start()
    try:
        await agent.ready(gw)
        yield agent
    finally:
        agent.stop()


@pytest.fixture
async def tenants(stack: Stack, gw: httpx.AsyncClient) -> AsyncIterator[tuple[Tenant, Tenant]]:
    """Two unrelated tenants (each a project admin with a personal SSH key)."""
    a, b = await tenant(stack, gw, "isoa"), await tenant(stack, gw, "isob")
    yield a, b
    await a.client.aclose()
    await b.client.aclose()
