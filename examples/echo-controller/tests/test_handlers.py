"""Echo's handlers on the in-memory harness (no stack, no SSH: shells answer as the scripts would), in seconds:
deploy, the server's address shared through the stored state, workers after the server whatever the order
they were requested in, a dead worker found by reconcile, a planned drain, and decommission removing the
workers before the server with verified teardown. The same controller against a real stack:
tests/e2e/test_echo_controller.py."""

from __future__ import annotations

import uuid

from echo_controller import MANIFEST, EchoController

from gpuaas.sdk.controller import ExecResult
from gpuaas.sdk.controller.memory import InMemoryHarness, ShellCall


class Host:
    """What the scripts would answer, per member: a port for the server, a pid for a worker; `dead` members'
    processes are gone; `stuck` members' teardown cannot be verified."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.stuck: set[str] = set()
        self.ran: list[tuple[str, str]] = []  # (script, member)

    def __call__(self, call: ShellCall) -> ExecResult:
        member = call.input.split("MEMBER=", 1)[1].split()[0].strip("'")
        if "http.server" in call.input:
            self.ran.append(("start_server", member))
            return ExecResult("PORT=8123\n", "", 0)
        if "last.tmp" in call.input:
            self.ran.append(("start_worker", member))
            return ExecResult("PID=4242\n", "", 0)
        if "rm -rf" in call.input:
            self.ran.append(("teardown", member))
            if member in self.stuck:
                return ExecResult("process 4242 still running\n", "", 1)
            return ExecResult(f"process 4242 gone, ~/echo/{member} removed\n", "", 0)
        if "echo alive" in call.input:
            return ExecResult("dead\n" if member in self.dead else "alive\n", "", 0)
        self.ran.append(("stop", member))
        return ExecResult("stopped 4242\n", "", 0)


def harness() -> tuple[InMemoryHarness, Host]:
    h = InMemoryHarness(EchoController(), manifest=MANIFEST)
    host = Host()
    h.on_shell(host)
    return h, host


def role_of(h: InMemoryHarness, member_id: str) -> str:
    return h.members_[uuid.UUID(member_id)]["component_key"]


async def test_deploy_shares_the_server_address_and_reports_health() -> None:
    h, _ = harness()
    iid = h.deploy({"greeting": "hello"}, server=1, worker=2)
    await h.settle()
    inst = h.instance(iid)
    assert inst.status == "running"
    url = h.state(iid)["server"]["url"]
    assert url.startswith("http://10.0.") and url.endswith(":8123/index.html")
    details = {m["component_key"]: m["detail"] for m in h.members(iid)}
    assert details["server"]["port"] == 8123
    assert details["worker"] == {"pid": 4242, "polls": url}
    kinds = [e["kind"] for e in h.events]
    assert kinds == ["controller.server_up", "controller.worker_joined", "controller.worker_joined"]
    assert (inst.health.status, inst.health.message) == ("healthy", "2 worker(s) polling; 0 dead")
    assert inst.runtime_detail == {"url": url, "workers": 2}
    greeting = next(c for c in h.shell_calls if "http.server" in c.input)
    assert "GREETING=hello" in greeting.input


async def test_workers_requested_first_still_start_after_the_server() -> None:
    h, host = harness()
    iid = h.deploy({"greeting": "hi"}, worker=2)  # the workers' adds first ...
    h.add(iid, "server")  # ... the server's last
    await h.settle()
    assert [s for s, _ in host.ran] == ["start_server", "start_worker", "start_worker"]
    assert h.instance(iid).status == "running"
    assert all(o["attempt"] == 1 for o in h.operations.values())  # nothing retried or deferred


async def test_reconcile_finds_a_dead_worker() -> None:
    h, host = harness()
    iid = h.deploy({"greeting": "hi"}, server=1, worker=2)
    await h.settle()
    worker = next(m for m in h.members(iid) if m["component_key"] == "worker")
    host.dead.add(worker["member_id"])
    await h.reconcile(iid)
    assert worker["status"] == "failed" and worker["detail"] == {"reason": "process not running"}
    inst = h.instance(iid)
    assert inst.status == "degraded" and inst.health.message == "1 worker(s) polling; 1 dead"


async def test_a_drained_worker_keeps_the_instance_running_and_is_removed_without_draining_again() -> None:
    h, host = harness()
    iid = h.deploy({"greeting": "hi"}, server=1, worker=2)
    await h.settle()
    worker = next(m for m in h.members(iid) if m["component_key"] == "worker")
    h.request(uuid.UUID(worker["member_id"]), "drain")
    await h.settle()
    assert worker["status"] == "stopped" and h.instance(iid).status == "running"
    host.ran.clear()
    h.request(uuid.UUID(worker["member_id"]), "remove")
    await h.settle()
    assert host.ran == [("teardown", worker["member_id"])]  # drained before: no second drain


async def test_decommission_removes_workers_first_each_drained_then_verified() -> None:
    h, host = harness()
    iid = h.deploy({"greeting": "hi"}, server=1, worker=2)
    await h.settle()
    host.ran.clear()
    await h.decommission(iid)
    assert [(s, role_of(h, m)) for s, m in host.ran] == [
        ("stop", "worker"),
        ("teardown", "worker"),
        ("stop", "worker"),
        ("teardown", "worker"),
        ("teardown", "server"),
    ]
    inst = h.instance(iid)
    assert inst.status == "decommissioned" and inst.runtime_detail == {}
    assert inst.decommission is not None and len(inst.decommission.verified_member_ids) == 3
    assert "server" not in h.state(iid)


async def test_an_unverified_teardown_fails_the_decommission() -> None:
    h, host = harness()
    iid = h.deploy({"greeting": "hi"}, server=1, worker=1)
    await h.settle()
    server = next(m for m in h.members(iid) if m["component_key"] == "server")
    host.stuck.add(server["member_id"])
    await h.decommission(iid)
    inst = h.instance(iid)
    assert inst.status == "decommission_failed"
    assert inst.decommission is not None and inst.decommission.unverified_member_ids == [uuid.UUID(server["member_id"])]
