"""A real OCI registry (Debian's `docker-registry`, the CNCF Distribution server) on a loopback port,
for local runs and tests (`make demo`, the catalog's trust tests, the e2e and fault suites).

Nothing is installed here: when the binary is missing, `start()` raises `RegistryMissing` naming the
Debian packages to install."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx

from gpuaas.devstack.infra import free_port

APT_PACKAGES = ("docker-registry", "skopeo", "umoci")
REGISTRY_BINARY = "docker-registry"


class RegistryMissing(RuntimeError):
    pass


def missing_message(what: str) -> str:
    return (
        f"{what} not found: the catalog trust tests need a real OCI registry and the OCI tools. Install them with "
        f"`apt-get install -y --no-install-recommends {' '.join(APT_PACKAGES)}` (Debian 12; `make install` does it)."
    )


def require_tools(*names: str) -> dict[str, str]:
    found = {}
    for name in names:
        path = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
        if path is None:
            raise RegistryMissing(missing_message(f"`{name}`"))
        found[name] = path
    return found


class LocalRegistry:
    """`docker-registry serve` on 127.0.0.1:<port> with filesystem storage under `root`."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = Path(root)
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def storage(self) -> Path:
        return self.root / "data"

    def blob_file(self, digest: str) -> Path:
        """Where the registry stores a blob (overwrite it to simulate tampering: the registry does not notice)."""
        algorithm, hexdigest = digest.split(":", 1)
        return self.storage / "docker/registry/v2/blobs" / algorithm / hexdigest[:2] / hexdigest / "data"

    blob_path = blob_file

    def start(self, timeout_s: float = 15.0) -> LocalRegistry:
        binary = require_tools(REGISTRY_BINARY)[REGISTRY_BINARY]
        self.storage.mkdir(parents=True, exist_ok=True)
        config = self.root / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.address}\n"
        )
        log = (self.root / "registry.log").open("ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
        self.proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=log, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited with {self.proc.returncode}; see {self.root}/registry.log")
            try:
                if httpx.get(f"{self.url}/v2/", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"docker-registry did not answer on {self.address} within {timeout_s}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
