"""`gpuaas apps drain` against a real local HTTP server answering as the platform does: the member is resolved
by its allocation, and the drain is requested with its deadline (an operation of kind `drain`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from typer.testing import CliRunner

from gpuaas.cli.config import Config
from gpuaas.cli.main import app

from .test_open_and_daily import PROJECT, SLURM, instance

MEMBER = "019ab8c4-1f2e-7c03-8000-000000000003"
ALLOC = "019ab8c4-1f2e-7d04-8000-000000000004"


def member() -> dict[str, Any]:
    return {
        "member_id": MEMBER,
        "instance_id": SLURM,
        "component_key": "worker",
        "allocation_id": ALLOC,
        "status": "active",
        "status_changed_at": "2026-11-24T12:00:00Z",
        "last_operation_id": None,
        "detail": {},
        "tombstoned": False,
        "tombstone_reason": None,
        "version": 2,
    }


def operation(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "operation_id": "019ab8c4-1f2e-7e05-8000-000000000005",
        "instance_id": SLURM,
        "project_id": PROJECT,
        "app_slug": "slurm-reference",
        "kind": body["kind"],
        "status": "pending",
        "member_id": body["member_id"],
        "result_member_id": None,
        "component_key": "worker",
        "allocation_id": ALLOC,
        "params": body["params"],
        "claimed_by": None,
        "lease_expires_at": None,
        "attempt": 0,
        "progress_message": "",
        "progress_percent": None,
        "error": None,
        "forced": False,
        "result": {},
        "version": 1,
        "created_at": "2026-11-24T12:00:00Z",
        "updated_at": "2026-11-24T12:00:00Z",
    }


@pytest.fixture
def platform() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    requested: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def answer(self, data: Any, status: int = 200) -> None:
            body = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            if path == f"/api/app-runtime/instances/{SLURM}/members":
                self.answer({"items": [member()]})
            elif path == "/api/app-runtime/instances":
                self.answer({"items": [instance(SLURM, "cluster", "slurm-reference", None)]})
            else:
                self.send_error(404)

        def do_POST(self) -> None:
            if urlsplit(self.path).path != f"/api/app-runtime/instances/{SLURM}/operations":
                self.send_error(404)
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requested.append(body)
            self.answer(operation(body), 201)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requested
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPUAAS_CONFIG", str(tmp_path / "cfg" / "config.json"))
    monkeypatch.delenv("GPUAAS_URL", raising=False)
    monkeypatch.delenv("GPUAAS_PROJECT", raising=False)
    Config(access_token="the-session-token").save()
    return tmp_path


def test_drain_requests_a_drain_of_the_member_with_its_deadline(platform: tuple[str, list[dict[str, Any]]]) -> None:
    url, requested = platform
    args = ["--url", url, "--project", PROJECT, "apps", "drain", "cluster", ALLOC, "--deadline-s", "120"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Requested drain: pending" in result.output
    assert requested == [
        {
            "kind": "drain",
            "member_id": MEMBER,
            "allocation_id": None,
            "component_key": None,
            "params": {"deadline_s": 120},
        }
    ]
