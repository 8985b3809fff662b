"""The per-instance secret of a launchable app's workload (issue 21).

The workload (e.g. JupyterLab) refuses every request without this secret; only the platform knows it:
allocations derives it for the node agent's provision task and the gateway derives it to add upstream on
`/apps/{instance_id}/`. It is an HMAC of the instance id under a key both hold (`GPUAAS_WORKLOAD_TOKEN_KEY`,
from the deployment's secret store), so nothing is stored, no event carries it and no user ever sees it.
Rotating the key changes every workload's secret: running workloads keep the old one until restarted.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import uuid

ENV = "GPUAAS_WORKLOAD_TOKEN_KEY"
MIN_KEY_CHARS = 32


class WorkloadTokenKeyMissing(RuntimeError):
    pass


def key_from_env() -> bytes:
    key = os.environ.get(ENV, "")
    if len(key) < MIN_KEY_CHARS:
        raise WorkloadTokenKeyMissing(f"{ENV} is not set (at least {MIN_KEY_CHARS} characters)")
    return key.encode()


def derive(key: bytes, instance_id: uuid.UUID | str) -> str:
    mac = hmac.new(key, f"gpuaas-workload-token:v1:{uuid.UUID(str(instance_id))}".encode(), hashlib.sha256)
    return base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")
