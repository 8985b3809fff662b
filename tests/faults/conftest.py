"""Fault injection on the whole suite as real processes (`make test-faults`; also part of `make test-kafka`).

The stack runs its own broker: Apache Kafka with `GPUAAS_STACK_BROKER=kafka` (what these tests are
for: its log survives a broker stop), else Tansu. One stack per session; every test leaves it whole.
The harness (operator tokens that outlive a long run, the `gw` client) is the devstack's pytest plugin.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpuaas.devstack.pytest_plugin import run_stack
from gpuaas.devstack.stack import Stack


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    # The tests start their own node-agents (to kill them); the stack's local demo agents are not needed.
    yield from run_stack(request, "gpuaas-faults-", agents=())
