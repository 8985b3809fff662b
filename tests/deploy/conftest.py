"""Fault tests against the compose deployment (deploy/compose): `make deploy-test` runs them with GPUAAS_DEPLOY_URL
set (the gateway through `lb`); `make test` leaves this folder out (--ignore=tests/deploy). Without
GPUAAS_DEPLOY_URL every test here is skipped, saying so; with it, an unreachable deployment is a failure.

Variables (defaults: deploy/compose/README.md): GPUAAS_DEPLOY_URL (http://127.0.0.1:18000),
GPUAAS_DEPLOY_ALLOCATIONS_PORT (18002), GPUAAS_DEPLOY_PG_PORT (15432), GPUAAS_SECRETS_DIR (.local/compose/secrets),
CONTAINERS_CONF (deploy/local/containers.conf). The devstack plugin's `gw` (the operator, tokens refreshed) is
used with `stack` bound to the deployment.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.faults.workload import Saga

from .deployment import Deployment

SKIP_REASON = (
    "GPUAAS_DEPLOY_URL is not set: no compose deployment to test (`make deploy-test` starts deploy/compose and sets it)"
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "deploy: runs against the compose deployment (make deploy-test)")


@pytest.fixture(scope="session")
def deployment() -> Deployment:
    found = Deployment.from_env()
    if found is None:
        pytest.skip(SKIP_REASON)
    try:
        r = httpx.get(f"{found.gateway_url}/healthz", timeout=10)
    except httpx.HTTPError as exc:
        pytest.fail(f"GPUAAS_DEPLOY_URL={found.gateway_url} does not answer: {exc!r}", pytrace=False)
    assert r.status_code == 200, f"{found.gateway_url}/healthz -> {r.status_code} {r.text[:200]}"
    assert found.secrets.is_dir(), f"no secrets at {found.secrets} (GPUAAS_SECRETS_DIR)"
    return found


@pytest.fixture(scope="session")
def stack(deployment: Deployment) -> Deployment:
    """What the devstack plugin's fixtures (`gw`, `admin_tokens`) and the fault suite's saga take as the stack."""
    return deployment


@pytest.fixture
async def saga(deployment: Deployment, gw: httpx.AsyncClient) -> AsyncIterator[Saga]:
    s = Saga(deployment, gw)  # a Deployment offers what the saga uses of a Stack
    await s.setup()
    yield s
    await s.close()
