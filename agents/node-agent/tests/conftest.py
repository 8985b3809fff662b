"""Fixtures for the node agent's driver tests (helpers in agent_harness.py)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

# The suite runs with --import-mode=importlib and this folder is no package (agents/node-agent has a
# dash): put it on the path so the test modules can import their shared helpers.
sys.path.insert(0, str(Path(__file__).parent))

from agent_harness import Host, agent_settings, containers_of, podman, start_host, stop_host


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from gpuaas.devstack.registry import LocalRegistry

    reg = LocalRegistry(tmp_path_factory.mktemp("registry")).start()
    yield reg
    reg.stop()


@pytest.fixture(scope="session")
def runtime(registry: Any) -> dict[str, str]:
    """{image, digest} of gpuaas-base in the session's registry (what a provision payload carries)."""
    from gpuaas.devstack import runtime_images

    (built,) = runtime_images.ensure_images(["gpuaas-base"])
    pushed = runtime_images.push_image(built, registry.address)
    return {"image": pushed.ref, "digest": pushed.digest}


@pytest.fixture
async def container_host(tmp_path: Path, runtime: dict[str, str]) -> AsyncIterator[Host]:
    host = await start_host(agent_settings(tmp_path / "agent", "container"))
    yield host
    await stop_host(host)
    for name in containers_of(host.agent):
        podman("rm", "-f", "-t", "0", name, check=False)


@pytest.fixture
async def process_host(tmp_path: Path) -> AsyncIterator[Host]:
    host = await start_host(agent_settings(tmp_path / "agent", "process"))
    yield host
    await stop_host(host)
