"""The agent speaks the typed protocol (`gpuaas.contracts.agent`) and tolerates the control plane's versions:
a payload from a newer control plane (fields this agent does not know) runs as if they were absent, a lease in
the shape the control plane sent before the typed protocol (no `kind` in the payload) runs, and a task of a
kind this agent does not know is reported failed with the reason instead of stopping the task loop."""

from __future__ import annotations

import http.server
import json
import threading
import uuid
from pathlib import Path
from typing import Any, ClassVar

import asyncssh
import httpx
from agent_harness import Host

from gpuaas.contracts.agent import TASK_TYPES, ProvisionTask, TaskCompletion, TaskLease
from gpuaas.node_agent.agent import HANDLERS

SAMPLES = json.loads(
    (Path(__file__).resolve().parents[3] / "libs/contracts/tests/samples/protocol-v0.json").read_text()
)


def newer(doc: Any) -> Any:
    """`doc` as a newer control plane might send it: an unknown field in every object."""
    if isinstance(doc, dict):
        return {**{k: newer(v) for k, v in doc.items()}, "preemptible": {"since": "v2"}}
    if isinstance(doc, list):
        return [newer(v) for v in doc]
    return doc


def test_every_task_type_has_a_handler() -> None:
    assert ProvisionTask in HANDLERS and set(HANDLERS) == set(TASK_TYPES)


async def test_a_newer_control_planes_payload_provisions_and_releases(process_host: Host) -> None:
    h = process_host
    p = h.payload("nora", [2], volumes=[{"volume_id": str(uuid.uuid4()), "mount_path": "/data"}])

    result = await h.task("provision", newer(p))

    assert result["username"] == "nora" and result["driver"] == "process"
    ws = h.agent.workspaces.get(p["allocation_id"])
    assert ws.active and ws.gpu_indices == [2] and "preemptible" not in ws.meta
    assert (await h.ssh("nora", "echo $CUDA_VISIBLE_DEVICES")).stdout.strip() == "2"
    evidence = (await h.task("release", newer({**p, "volumes": []})))["evidence"]
    assert evidence["state_dir_gone"] is True, evidence


async def test_a_lease_in_the_shape_before_the_typed_protocol_runs(process_host: Host) -> None:
    h = process_host
    old = SAMPLES["tasks"]["provision_process_host"]
    key = h.keys.setdefault("olga", asyncssh.generate_private_key("ssh-ed25519"))
    payload = {**old, "allocation_id": str(uuid.uuid4()), "username": "olga", "gpu_indices": [3]}
    payload["authorized_keys"] = [key.export_public_key().decode().strip()]
    assert "kind" not in payload

    lease = TaskLease.model_validate({"task_id": str(uuid.uuid4()), "kind": "provision", "payload": payload})
    result = await h.agent.execute(lease)

    assert result.kind == "provision"
    assert (await h.ssh("olga", "echo $CUDA_VISIBLE_DEVICES")).stdout.strip() == "3"
    await h.task("release", {"allocation_id": payload["allocation_id"], "username": "olga"})


class Recorder(http.server.BaseHTTPRequestHandler):
    """A loopback HTTP endpoint that records what the agent posts (a control plane newer than the agent,
    which hands it a kind it does not know, is not something this repository can run)."""

    posts: ClassVar[list[tuple[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.posts.append((self.path, json.loads(body or b"null")))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"applied": true}')

    def log_message(self, *args: Any) -> None:
        pass


async def test_an_unknown_kind_is_reported_failed_with_its_reason(process_host: Host) -> None:
    h = process_host
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    h.agent.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.server_address[1]}")
    task_id = str(uuid.uuid4())
    try:
        await h.agent.handle_raw({"task_id": task_id, "kind": "migrate", "payload": {"allocation_id": task_id}})
        await h.agent.handle_raw("not a task")  # nothing to report it to: logged and skipped
    finally:
        server.shutdown()

    (path, body), *rest = Recorder.posts
    assert path == f"/agent/tasks/{task_id}/complete" and rest == [], Recorder.posts
    report = TaskCompletion.model_validate(body)
    assert report.ok is False and "cannot read task kind 'migrate'" in report.message, report
    assert h.agent.journal.get(task_id) is None  # it never ran


async def test_the_journal_keeps_the_completion_body(process_host: Host) -> None:
    h = process_host
    h.agent.stopping.set()
    p = h.payload("jana", [1])
    lease = TaskLease.model_validate({"task_id": str(uuid.uuid4()), "kind": "provision", "payload": p})

    await h.agent.handle(lease)

    outcome = h.agent.journal.get(str(lease.task_id))
    assert isinstance(outcome, TaskCompletion) and outcome.ok, outcome
    assert outcome.result["kind"] == "provision" and outcome.result["username"] == "jana"
    on_disk = json.loads((h.agent.state_dir / "journal.json").read_text())[str(lease.task_id)]
    assert TaskCompletion.model_validate(on_disk) == outcome
    await h.task("release", {"allocation_id": p["allocation_id"], "username": "jana"})
