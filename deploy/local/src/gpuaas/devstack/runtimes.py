"""The stack's OCI registry and managed runtime images: what makes allocations run in containers.

With podman installed (and the catalog among the stack's services), `Stack.start()`:
1. starts Debian's `docker-registry` on a loopback port with its storage under <root>/registry (kept
   across `make run` restarts, so digests the catalog pinned stay pullable);
2. in a background thread while the services start: builds the runtime images (cached, see
   runtime_images), pushes them to the registry and smoke-tests each once with podman;
3. once the services are ready and before the agents start: registers each pushed digest in the catalog
   through its public API as the operator (artifact → lint/smoke checks → staged → canary for the
   devstack's `platform-canary` tenant → active → a `runtime`-kind app version, active). Idempotent.

The node agents then run with the container driver (`agent_env()`); without podman, or when the images
cannot be built, they run with the process driver and the log says why.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from gpuaas.devstack import runtime_images as ri
from gpuaas.devstack.config import StackConfig
from gpuaas.devstack.credentials import Credentials
from gpuaas.devstack.registry import REGISTRY_BINARY, LocalRegistry, RegistryMissing, require_tools

log = logging.getLogger("gpuaas.devstack")

CANARY_TENANT_SLUG = "platform-canary"
SEED_REASON = "devstack seed: runtime image built from its recipe, pushed and smoke-tested with podman"
SEED_TIMEOUT_S = 90.0


def runtimes_wanted(config: StackConfig, services: Sequence[str]) -> bool:
    """Explicit (config.runtime_images), else: podman and the registry are installed, the stack runs the
    catalog (and identity, whose operator seeds it), and the agents are not pinned to the process driver."""
    if config.runtime_images is not None:
        return config.runtime_images
    if config.agent_driver == "process" or not {"catalog", "identity"} <= set(services):
        return False
    if not ri.podman_available():
        log.warning("podman is not installed: the node agents use the process driver (no tenant isolation)")
        return False
    try:
        require_tools(REGISTRY_BINARY)
    except RegistryMissing as exc:
        log.warning("no runtime images: %s", exc)
        return False
    return True


def remembered_port(root: Path) -> int | None:
    """The registry port of this root's previous run: the catalog pinned references with that address."""
    try:
        return int((root / "registry" / "port").read_text())
    except (OSError, ValueError):
        return None


class LocalRuntimes:
    """The registry process, the pushed runtime images and their catalog entries for one Stack."""

    def __init__(
        self,
        enabled: bool,
        root: Path,
        port: int,
        credentials: Credentials,
        service_url: Callable[[str], str],
        slugs: Sequence[str] = ri.DEFAULT_IMAGES,
        agent_driver: str | None = None,
    ) -> None:
        self.enabled = enabled
        self.registry = LocalRegistry(root / "registry", port) if enabled else None
        self.credentials = credentials
        self.service_url = service_url
        self.slugs = tuple(slugs)
        self.wanted_driver = agent_driver  # None: container when the runtime images are there
        self.images: list[ri.BuiltImage] = []
        self.pushed: dict[str, ri.PushedImage] = {}
        self.smoke: dict[str, str] = {}
        self.seeded: dict[str, dict[str, str]] = {}
        self.error: str | None = None  # the images could not be built/pushed (the agents use the process driver)
        self.seed_error: str | None = None  # the catalog did not take them (allocations cannot use them)
        self.timings: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._reported = False
        self._jobs = ri.Jobs()  # the build/push subprocesses, stopped by stop()
        self._seed_thread: threading.Thread | None = None
        self._default_seeded = threading.Event()
        self._stopping = threading.Event()

    @property
    def address(self) -> str | None:
        return self.registry.address if self.registry else None

    @property
    def ready(self) -> bool:
        return self.enabled and self.error is None and len(self.pushed) == len(self.slugs)

    @property
    def driver(self) -> str:
        if self.wanted_driver:
            return self.wanted_driver
        return "container" if self.ready else "process"

    # ------------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the registry and the image build/push, in the background (the stack starts meanwhile)."""
        if self.registry is None:
            return
        # Agents that tests start themselves inherit this process's environment: podman on this machine kind
        # works only with the project's containers.conf (runc, no default ulimits).
        os.environ.setdefault("CONTAINERS_CONF", str(ri.CONTAINERS_CONF))
        self._thread = threading.Thread(target=self._prepare, name="runtime-images", daemon=True)
        self._thread.start()

    def _prepare(self) -> None:
        assert self.registry is not None
        with self._jobs.installed():
            self._build_and_push()

    def _build_and_push(self) -> None:
        assert self.registry is not None
        try:
            t0 = time.monotonic()
            self.registry.start()
            (self.registry.root / "port").write_text(str(self.registry.port))
            self.timings["registry_start_s"] = time.monotonic() - t0
            log.info("OCI registry on %s (storage %s)", self.registry.address, self.registry.storage)
            t0 = time.monotonic()
            self.images = ri.ensure_images(self.slugs)
            t1 = time.monotonic()
            pushed = ri.publish(self.images, self.registry.storage, self.registry.address)
            t2 = time.monotonic()
            for image in self.images:
                self.smoke[image.slug] = ri.smoke_test(image)
            self.timings.update(build_s=t1 - t0, push_s=t2 - t1, smoke_s=time.monotonic() - t2)
            self.pushed = pushed
        except Exception as exc:  # reported by wait(): the stack then runs its agents with the process driver
            self.error = f"{type(exc).__name__}: {exc}"

    def wait(self, timeout_s: float = 1800.0) -> bool:
        """Wait for the build/push; False (and the reason in `error`) when the images are not there."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self.error = f"runtime images not ready after {timeout_s:.0f}s"
        if self.enabled and self.error and not self._reported:
            self._reported = True
            log.error("runtime images unavailable, the agents use the process driver: %s", self.error)
        return self.ready

    def stop(self) -> None:
        """Stop the build/push and the seed (call it once the services are down: no request is left
        waiting on them), then the registry."""
        self._stopping.set()
        self._jobs.cancel()
        for thread in (self._thread, self._seed_thread):
            if thread is not None:
                thread.join(15)
        if self.registry is not None:
            self.registry.stop()

    # ----------------------------------------------------------------------------------------- seed

    def start_seed(self) -> None:
        """seed() in a thread: the catalog downloads and hashes every blob at registration and at each
        promotion (~30 s for both images on two busy cores), meanwhile the agents enrol. The images are seeded
        in order, the platform default (gpuaas-base) first: `wait_seeded(default_only=True)` waits for it,
        `wait_seeded()` for all."""
        self._seed_thread = threading.Thread(target=self.seed, name="runtime-seed", daemon=True)
        self._seed_thread.start()

    def wait_seeded(self, timeout_s: float = 600.0, default_only: bool = False) -> bool:
        """True when the catalog holds the default image (default_only) or every image, active."""
        if default_only:
            self._default_seeded.wait(timeout_s)
        elif self._seed_thread is not None:
            self._seed_thread.join(timeout_s)
        wanted = self.slugs[:1] if default_only else self.slugs
        return all(slug in self.seeded for slug in wanted)

    def seed(self) -> None:
        """Register and promote the pushed images in the catalog (idempotent); a failure is logged, not
        raised: the stack stays usable without the runtimes (allocations on container hosts then fail)."""
        try:
            if self.wait():
                self._seed()
        finally:
            self._default_seeded.set()

    def _seed(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + SEED_TIMEOUT_S
        last = ""
        while not self._stopping.is_set():
            try:
                with self._operator() as op:
                    tenant_id = self._canary_tenant(op)
                    for image in self.images:
                        if image.slug not in self.seeded:
                            self.seeded[image.slug] = self._seed_one(op, image, tenant_id)
                            self._default_seeded.set()
                            log.info("catalog: runtime %s %s active", image.slug, image.version)
                self.timings["seed_s"] = time.monotonic() - t0
                return
            except SeedFailed as exc:
                self.seed_error = f"catalog seed of the runtimes failed: {exc}"
                log.error("%s", self.seed_error)
                return
            except (httpx.HTTPError, SeedNotYet) as exc:
                last = str(exc)
                log.debug("runtime seed: retrying after %s", last)
            if time.monotonic() > deadline:
                self.seed_error = f"catalog seed of the runtimes failed: {last}"
                log.error("%s", self.seed_error)
                return
            self._stopping.wait(1.0)

    def _operator(self) -> httpx.Client:
        email, password = self.credentials.admin_login
        r = httpx.post(
            f"{self.service_url('identity')}/auth/token",
            data={"grant_type": "password", "username": email, "password": password},
            timeout=30,
        )
        r.raise_for_status()
        return httpx.Client(timeout=60, headers={"Authorization": f"Bearer {r.json()['access_token']}"})

    def _canary_tenant(self, op: httpx.Client) -> str:
        identity = self.service_url("identity")
        for tenant in _ok(op.get(f"{identity}/tenants")):
            if tenant["slug"] == CANARY_TENANT_SLUG:
                return str(tenant["tenant_id"])
        r = op.post(f"{identity}/tenants", json={"slug": CANARY_TENANT_SLUG, "name": "Platform canary (devstack)"})
        return str(_ok(r)["tenant_id"])

    def _seed_one(self, op: httpx.Client, image: ri.BuiltImage, tenant_id: str) -> dict[str, str]:
        catalog = self.service_url("catalog")
        pushed = self.pushed[image.slug]
        recipe = image.recipe
        artifact = next((a for a in _ok(op.get(f"{catalog}/artifacts?limit=1000")) if a["ref"] == pushed.ref), None)
        if artifact is None:
            artifact = _ok(op.post(f"{catalog}/artifacts", json={"ref": pushed.ref, "kind": "oci"}))
        aid = artifact["artifact_id"]
        if artifact["state"] == "draft":
            checks = {
                "lint": f"recipe deploy/images/runtimes/{image.slug}.toml (hash {recipe.recipe_hash[:12]}), mmdebstrap",
                "smoke": f"podman run: gpuaas-init + sudo ok; {self.smoke[image.slug]}",
            }
            for name, detail in checks.items():
                body = {"name": name, "passed": True, "detail": detail[:2000]}
                artifact = _ok(op.post(f"{catalog}/artifacts/{aid}/checks", json=body))
        path = ["staged", "canary", "active"]
        while artifact["state"] in path[:-1] or artifact["state"] == "draft":
            target = path[path.index(artifact["state"]) + 1] if artifact["state"] in path else "staged"
            r = op.post(
                f"{catalog}/artifacts/{aid}/transitions",
                json={"to": target, "reason": SEED_REASON, "canary_tenants": [tenant_id] if target == "canary" else []},
            )
            if r.status_code == 422 and target == "canary":
                raise SeedNotYet(f"catalog does not know tenant {tenant_id} yet: {r.text[:200]}")
            artifact = _ok(r)
        versions = _ok(op.get(f"{catalog}/apps/{image.slug}"), missing_ok=True) or []
        manifest = next((m for m in versions if m["version"] == recipe.version), None)
        if manifest is None:
            body: dict[str, Any] = {
                "slug": recipe.slug,
                "display_name": recipe.display_name,
                "description": recipe.description,
                "version": recipe.version,
                "runtime_version": recipe.runtime_version or None,
                "artifact_kind": "runtime",
                "artifact_ref": pushed.ref,
                "compatibility": {"min_gpu_count": 0},
                "active": True,
            }
            manifest = _ok(op.post(f"{catalog}/apps", json=body))
        if recipe.app:  # the launchable app that runs this image (issue 21): same artifact, its own manifest
            self._seed_app(op, recipe.app, pushed.ref)
        return {
            "version": recipe.version,
            "ref": pushed.ref,
            "digest": pushed.digest,
            "artifact_id": str(aid),
            "artifact_state": str(artifact["state"]),
            "manifest_id": str(manifest["manifest_id"]),
        }

    def _seed_app(self, op: httpx.Client, app: dict[str, Any], ref: str) -> None:
        """The recipe's `[app]`: a launchable manifest whose runtime_profile (the workload) runs the image."""
        catalog = self.service_url("catalog")
        versions = _ok(op.get(f"{catalog}/apps/{app['slug']}"), missing_ok=True) or []
        if any(m["version"] == app["version"] for m in versions):
            return
        body = {
            "slug": app["slug"],
            "display_name": app["display_name"],
            "description": app.get("description", ""),
            "version": app["version"],
            "runtime_version": app.get("runtime_version"),
            "artifact_kind": "launchable",
            "artifact_ref": ref,
            "compatibility": {"min_gpu_count": int(app.get("min_gpu_count", 0))},
            "runtime_profile": {"image": ref, **app["runtime_profile"]},
            "active": True,
        }
        _ok(op.post(f"{catalog}/apps", json=body))
        log.info("catalog: launchable app %s %s active", app["slug"], app["version"])

    # ---------------------------------------------------------------------------------------- state

    def agent_env(self) -> dict[str, str]:
        """What the stack's node agents get for their runtime driver (once the images are pushed, or not)."""
        self.wait()
        env = {"GPUAAS_AGENT_DRIVER": self.driver}
        if env["GPUAAS_AGENT_DRIVER"] == "container":
            env["GPUAAS_AGENT_CONTAINERS_CONF"] = str(ri.CONTAINERS_CONF)
            env["GPUAAS_AGENT_REGISTRY_INSECURE"] = "true"  # plain HTTP, loopback only
        return env

    def state(self) -> dict[str, Any] | None:
        if self.registry is None:
            return None
        running = self.registry.proc is not None and self.registry.proc.poll() is None
        return {
            "address": self.registry.address,
            "url": self.registry.url,
            "storage": str(self.registry.storage),
            "log": str(self.registry.root / "registry.log"),
            "pid": self.registry.proc.pid if running and self.registry.proc else None,
            "images": {
                slug: {"ref": p.ref, "tag": p.tag_ref, "digest": p.digest, "version": p.version}
                for slug, p in self.pushed.items()
            },
            "agent_driver": self.driver,
            "error": self.error,
            "seed_error": self.seed_error,
        }


class SeedNotYet(RuntimeError):
    """The catalog cannot take a step yet (its projections lag identity's events): try again shortly."""


class SeedFailed(RuntimeError):
    """The catalog refused a step for good (e.g. a manifest it does not accept)."""


def _ok(r: httpx.Response, missing_ok: bool = False) -> Any:
    if missing_ok and r.status_code == 404:
        return None
    if r.status_code in (401, 403, 404) or r.status_code >= 500:
        # the IAM projections of a fresh stack may not know the operator yet
        raise SeedNotYet(f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:300]}")
    if r.status_code >= 400:
        raise SeedFailed(f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:500]}")
    return r.json()
