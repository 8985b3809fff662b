"""`make demo`: the golden path against the stack of `make run`, printing each step.

Reads the running stack's URLs and operator login from .local/stack.json (or $GPUAAS_STACK_JSON),
starts a throwaway OCI registry for the catalog's seed artifacts, then runs gpuaas.devstack.golden_path:
tenant and tenant admin, two GPU hosts enrolled, prices, catalog seeded; project, members and the
controller's service account; allocations with SSH and a grant; Slurm Reference deployed with the
reference controller (real Slurm), sbatch/srun; metering and billing; decommission and release;
audit. Everything it creates is a new tenant, so it can run again.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from gpuaas.devstack import runtime_images
from gpuaas.devstack.golden_path import Target, golden_path
from gpuaas.devstack.registry import LocalRegistry, RegistryMissing

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    path = Path(os.environ.get("GPUAAS_STACK_JSON", ROOT / ".local" / "stack.json"))
    try:
        state = json.loads(path.read_text())
    except OSError:
        print(f"no running stack: {path} is missing; start one with `make run` (in another terminal)", file=sys.stderr)
        return 2
    if not state.get("running"):
        print(f"the stack in {path} is not running; start it with `make run`", file=sys.stderr)
        return 2
    admin = state["logins"]["admin"]
    root = Path(state["root"])
    registry_state = state.get("registry") or {}
    agent_env = {"GPUAAS_AGENT_DRIVER": "process"}
    if registry_state.get("agent_driver") == "container":  # the stack's agents run containers: so do the demo's
        agent_env = {
            "GPUAAS_AGENT_DRIVER": "container",
            "GPUAAS_AGENT_CONTAINERS_CONF": str(runtime_images.CONTAINERS_CONF),
            "GPUAAS_AGENT_REGISTRY_INSECURE": "true",
        }
    target = Target(
        gateway_url=state["gateway"]["url"],
        allocations_url=state["services"]["allocations"]["url"],
        admin_login=(admin["email"], admin["password"]),
        root=root,
        logs_dir=root / "logs",
        agent_env=agent_env,
    )
    try:
        registry = LocalRegistry(Path(tempfile.mkdtemp(prefix="gpuaas-demo-registry-"))).start()
    except RegistryMissing as exc:
        print(str(exc), file=sys.stderr)
        return 2
    try:
        steps = asyncio.run(golden_path(target, registry.address))
    except (AssertionError, RuntimeError) as exc:
        print(f"\n[golden path] FAILED: {exc}\n(service logs: {root / 'logs'})", file=sys.stderr)
        return 1
    finally:
        registry.stop()
    took = sum(s["seconds"] for s in steps)
    print(f"\n[golden path] done in {took:.1f}s of steps; timings in {root}/golden-path.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
