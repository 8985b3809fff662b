"""Bad input against the whole suite as real processes: HTTP (schemathesis, oversized bodies) and topics.

Its own stack (session scope): the generated requests create junk, and malformed events are parked in
the consumers' dead letters; neither may leak into the e2e or fault tests' stack. The harness
(operator tokens, the `gw` client) is the devstack's pytest plugin.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpuaas.devstack.pytest_plugin import run_stack
from gpuaas.devstack.stack import Stack


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    # No local demo agents: nothing here allocates.
    yield from run_stack(request, "gpuaas-badinput-", agents=())
