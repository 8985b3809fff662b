"""The golden path (gpuaas.devstack.golden_path) on the test session's stack: every step through the
gateway, real Slurm in the allocations, a real OCI registry for the catalog. Fails with the reason
when this machine cannot run Slurm (not root, or `make install` has not installed slurm-wlm)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuaas.devstack.golden_path import golden_path
from gpuaas.devstack.pytest_plugin import target_of
from gpuaas.devstack.registry import LocalRegistry, RegistryMissing
from gpuaas.devstack.stack import Stack

pytestmark = pytest.mark.e2e


@pytest.fixture
def registry() -> Iterator[LocalRegistry]:
    try:
        reg = LocalRegistry(Path(tempfile.mkdtemp(prefix="gpuaas-golden-registry-"))).start()
    except RegistryMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    yield reg
    reg.stop()


async def test_golden_path(stack: Stack, registry: LocalRegistry) -> None:
    steps = await golden_path(target_of(stack), registry.address)
    names = [s["step"][:2].strip() for s in steps]
    assert names[:4] == ["1", "2", "3", "4a"] and names[-1] == "7", steps
    assert sum(s["seconds"] for s in steps) < 360, steps  # the bound: under ~6 minutes
