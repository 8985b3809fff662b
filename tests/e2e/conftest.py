"""The whole suite as separate processes (the same Stack that `make run` uses), once per test session.

The harness (operator tokens, the `gw` client) is the devstack's pytest plugin; waits are
`gpuaas.devstack.waiting.eventually`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpuaas.devstack.pytest_plugin import run_stack
from gpuaas.devstack.stack import Stack


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    # With the local demo agents: tests allocate on their declared GPUs.
    yield from run_stack(request, "gpuaas-e2e-")
