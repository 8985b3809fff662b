"""The role order the adapter relies on (slurmd workers `after` the slurmctld controller) is what the catalog's
slurm-reference manifest declares, and the platform's order (the SDK's in-memory model of it) hands out the
controller's add before an older worker add; a worker add that finds no live controller is deferred, not
failed. No stack, no Slurm: a scripted runner (about a second)."""

from __future__ import annotations

import uuid
from typing import Any

from gpuaas.catalog.seed import SEED_APPS
from gpuaas.sdk import Client
from gpuaas.sdk.controller.memory import InMemoryHarness
from gpuaas.slurm_reference.adapter import ROLES, SlurmReference
from gpuaas.slurm_reference.remote import NodeError, Runner


def test_the_catalog_manifest_declares_the_adapters_role_order() -> None:
    (slurm,) = [a["manifest"] for a in SEED_APPS if a["manifest"]["slug"] == "slurm-reference"]
    assert slurm["roles"] == list(ROLES)
    assert ROLES[1]["after"] == [ROLES[0]["key"]]


async def test_the_controllers_add_goes_first_and_a_worker_defers_without_one() -> None:
    calls: list[tuple[str, str]] = []  # (role of the allocation, action), in order
    roles: dict[uuid.UUID, str] = {}

    async def runner_factory(_client: Client, _iid: uuid.UUID, allocation_id: uuid.UUID, _on_wait: Any) -> Runner:
        async def run(cluster_id: str, action: str, timeout_s: float = 120, **env: Any) -> dict[str, str]:
            role = roles[allocation_id]
            calls.append((role, action))
            if role == "controller":  # its bootstrap fails: the controller member is failed
                raise NodeError("slurmctld cannot start here")
            return {"HOSTNAME": "w1", "CPUS": "4"}

        return run

    manifest = {"slug": "slurm-reference", "version": "1.0.0", "roles": list(ROLES)}
    h = InMemoryHarness(SlurmReference(runner_factory), manifest=manifest)
    iid = h.deploy({"cluster_name": "acme"}, worker=1)  # the worker's add is the older one
    h.add(iid, "controller")
    for op in h.operations.values():
        roles[uuid.UUID(op["allocation_id"])] = op["component_key"]
    await h.settle()
    assert calls[0] == ("controller", "precheck")  # handed out first, although requested second
    worker_add = next(o for o in h.operations.values() if o["component_key"] == "worker")
    assert (worker_add["status"], worker_add["attempt"]) == ("pending", 0)  # deferred: no attempt used
    assert worker_add["_deferred"] and calls[1:] == [("worker", "precheck")]
    await h.aclose()
