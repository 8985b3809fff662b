"""The golden path (gpuaas.devstack.golden_path) through the compose deployment's gateway: two replicas of every
service and of the gateway behind `lb`, three Kafka brokers, every step through http://127.0.0.1:18000.

The scenario's own node agents run on this machine (process driver, real Slurm) and dial allocations through the
published `lb` port, as test hosts outside the compose network. The catalog seeds its artifacts into a real OCI
registry that the catalog replicas can reach: Debian's `docker-registry` (the host's binary, mounted read-only)
in a container on the compose network, named `registry` there (compose.yaml lets the catalog use plain HTTP to
it). It is removed after the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from gpuaas.devstack.golden_path import golden_path
from gpuaas.devstack.golden_path.actors import Target

from .deployment import Deployment, podman

pytestmark = pytest.mark.deploy

REGISTRY_CONTAINER = "gpuaas-test-registry"
REGISTRY_IMAGE = os.environ.get("GPUAAS_NGINX_IMAGE", "localhost/gpuaas-nginx:1.22-bookworm")  # any Debian 12 base
NETWORK = os.environ.get("GPUAAS_DEPLOY_NETWORK", "gpuaas_default")
REGISTRY_CONFIG = (
    "version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: /tmp/registry\n  delete:\n    enabled: true\n"
    "http:\n  addr: 0.0.0.0:5000\n"
)


@pytest.fixture
def compose_registry() -> Iterator[str]:
    binary = shutil.which("docker-registry")
    if binary is None:
        pytest.fail("docker-registry is not installed (`make install` installs it)", pytrace=False)
    podman("rm", "-f", "-t", "0", REGISTRY_CONTAINER, check=False)
    podman(
        "run", "-d", "--name", REGISTRY_CONTAINER, "--network", NETWORK, "--network-alias", "registry",
        "-v", f"{binary}:/usr/local/bin/docker-registry:ro", "--entrypoint", "sh", REGISTRY_IMAGE, "-c",
        f"printf '%s' '{REGISTRY_CONFIG}' > /tmp/registry.yml && exec docker-registry serve /tmp/registry.yml",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            probe = subprocess.run(
                ["podman", "exec", "gpuaas-catalog-a", "/opt/gpuaas/venv/bin/python", "-c",
                 "import urllib.request; urllib.request.urlopen('http://registry:5000/v2/', timeout=3)"],
                capture_output=True, env={**os.environ, "CONTAINERS_CONF": os.environ.get(
                    "CONTAINERS_CONF", "deploy/local/containers.conf")},
            )  # fmt: skip
            if probe.returncode == 0:
                break
            assert time.monotonic() < deadline, f"the registry container does not answer: {probe.stderr[-500:]!r}"
            time.sleep(1)
        yield "registry:5000"
    finally:
        podman("rm", "-f", "-t", "0", REGISTRY_CONTAINER, check=False)


async def test_golden_path_through_the_deployment(deployment: Deployment, compose_registry: str) -> None:
    target = Target(
        deployment.gateway_url,
        deployment.allocations_url,
        deployment.admin_login,
        deployment.root,
        deployment.logs_dir,
        {"GPUAAS_AGENT_DRIVER": "process"},
    )
    steps = await golden_path(target, compose_registry)
    names = [s["step"][:2].strip() for s in steps]
    assert names[:4] == ["1", "2", "3", "4a"] and names[-1] == "7", steps
    assert sum(s["seconds"] for s in steps) < 360, steps
