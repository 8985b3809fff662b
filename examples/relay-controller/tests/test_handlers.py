"""Relay's handlers on the in-memory harness (no stack): the fake host keeps each allocation's relay files as
the scripts would, so a worker registering where no head runs, or a head torn down with workers still
registered, fails as it would for real. With the manifest's role order the app deploys whatever order its
members were requested in, and decommissions cleanly (each worker drained, then removed, then the head); the
same app without the order fails its decommission: the proof the order is needed."""

from __future__ import annotations

import uuid

from relay_controller import MANIFEST, RelayController

from gpuaas.sdk.controller import ExecResult
from gpuaas.sdk.controller.memory import InMemoryHarness, ShellCall


def var(script: str, name: str) -> str:
    return script.split(f"\n{name}=", 1)[1].split("\n", 1)[0].strip("'")


class Hosts:
    """Allocation → what the relay scripts left there: `head` (its roster: registered member ids) and the
    workers' processes."""

    def __init__(self) -> None:
        self.heads: dict[uuid.UUID, set[str]] = {}
        self.workers: dict[uuid.UUID, set[str]] = {}
        self.steps: list[tuple[str, str]] = []

    def __call__(self, call: ShellCall) -> ExecResult:
        step = call.input.split("\n", 1)[0].removeprefix("# relay:")
        at = call.allocation_id
        if step == "head_start":
            self.heads.setdefault(at, set())
            self.steps.append((step, "head"))
            return ExecResult("PID=100\n", "", 0)
        if step == "worker_start":
            self.workers.setdefault(at, set()).add(var(call.input, "MEMBER"))
            self.steps.append((step, "worker"))
            return ExecResult("PID=200\n", "", 0)
        if step == "register":
            if at not in self.heads:
                return ExecResult("", "no head here\n", 1)
            self.heads[at].add(var(call.input, "MEMBER"))
            return ExecResult("registered\n", "", 0)
        if step == "deregister":
            self.heads.get(at, set()).discard(var(call.input, "MEMBER"))
            self.steps.append((step, "worker"))
            return ExecResult("deregistered\n", "", 0)
        if step == "teardown":
            name = var(call.input, "NAME")
            self.steps.append((step, "head" if name == "head" else "worker"))
            if name == "head":
                if self.heads.get(at):
                    return ExecResult(f"workers still registered: {' '.join(sorted(self.heads[at]))}\n", "", 1)
                self.heads.pop(at, None)
            else:
                self.workers.get(at, set()).discard(name)
            return ExecResult(f"process gone, ~/relay/{name} removed\n", "", 0)
        if step == "roster":
            return ExecResult("\n".join(sorted(self.heads.get(at, set()))), "", 0)
        raise AssertionError(f"unexpected script {step!r}")


def harness(manifest: dict | None = None) -> tuple[InMemoryHarness, Hosts]:
    h = InMemoryHarness(RelayController(), manifest=manifest or MANIFEST)
    hosts = Hosts()
    h.on_shell(hosts)
    return h, hosts


def roster(hosts: Hosts) -> set[str]:
    (registered,) = hosts.heads.values()
    return registered


async def test_workers_requested_first_register_once_the_head_is_up() -> None:
    h, hosts = harness()
    iid = h.deploy({}, worker=2)  # the workers' adds first ...
    h.add(iid, "head")  # ... then the head's
    await h.settle()
    assert [s for s, _ in hosts.steps] == ["head_start", "worker_start", "worker_start"]
    workers = {m["member_id"] for m in h.members(iid) if m["component_key"] == "worker"}
    assert roster(hosts) == workers
    inst = h.instance(iid)
    assert inst.status == "running" and inst.health.message == "2 worker(s) registered"
    assert all(o["attempt"] == 1 for o in h.operations.values())


async def test_a_drained_worker_leaves_the_roster_and_the_instance_stays_running() -> None:
    h, hosts = harness()
    iid = h.deploy({}, head=1, worker=2)
    await h.settle()
    worker = next(m for m in h.members(iid) if m["component_key"] == "worker")
    h.request(uuid.UUID(worker["member_id"]), "drain", deadline_s=30)
    await h.settle()
    assert worker["member_id"] not in roster(hosts)
    assert worker["status"] == "stopped" and h.instance(iid).status == "running"
    assert [e["kind"] for e in h.events][-1] == "controller.worker_left"


async def test_decommission_drains_and_removes_the_workers_before_the_head() -> None:
    h, hosts = harness()
    iid = h.deploy({}, head=1, worker=2)
    await h.settle()
    hosts.steps.clear()
    await h.decommission(iid)
    assert hosts.steps == [("deregister", "worker"), ("teardown", "worker")] * 2 + [("teardown", "head")]
    inst = h.instance(iid)
    assert inst.status == "decommissioned" and inst.runtime_detail == {}
    assert inst.decommission is not None and len(inst.decommission.verified_member_ids) == 3


async def test_without_the_role_order_the_head_goes_first_and_the_decommission_fails() -> None:
    unordered = {**MANIFEST, "roles": [{"key": "head"}, {"key": "worker"}]}
    h, hosts = harness(unordered)
    iid = h.deploy({}, head=1, worker=2)
    await h.settle()
    await h.decommission(iid)
    assert hosts.steps[3] == ("teardown", "head")  # handed out first: its workers are still registered
    inst = h.instance(iid)
    assert inst.status == "decommission_failed"
    assert inst.decommission is not None and any("workers still registered" in e for e in inst.decommission.evidence)
