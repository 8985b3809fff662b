"""The security suite (issue 17) on its own stack, once per session (its junk never reaches e2e's).

The gateway trusts X-Forwarded-For from loopback here, so a test can speak as a load balancer on
loopback and name the client address (tests of client-address handling and per-source throttling);
a test that sends no X-Forwarded-For is its own address, as anywhere else. The harness (operator
tokens, the `gw` client) is the devstack's pytest plugin.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from gpuaas.devstack.pytest_plugin import run_stack
from gpuaas.devstack.stack import Stack

GATEWAY_TRUSTED_PROXIES = ["127.0.0.1", "::1"]


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    env = {"gateway": {"GPUAAS_GATEWAY_TRUSTED_PROXIES": json.dumps(GATEWAY_TRUSTED_PROXIES)}}
    yield from run_stack(request, "gpuaas-security-", agents=(), env=env)
