"""`gpuaas apps open` and `gpuaas cost --by day` (issue 21) against a real local HTTP server answering as the
platform does: open resolves the instance by name, prints the gateway URL without the token, hands the
browser the URL with the session's token; a non-launchable app is refused; the daily series is printed with
its currency, a running total and the budget."""

from __future__ import annotations

import json
import sys
import threading
import webbrowser
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from typer.testing import CliRunner

from gpuaas.cli.config import Config
from gpuaas.cli.main import app

PROJECT = "00000000-0000-7000-8000-0000000000aa"
LAB = "019ab8c4-1f2e-7a01-8000-000000000001"
SLURM = "019ab8c4-1f2e-7b02-8000-000000000002"


def instance(iid: str, name: str, slug: str, workload: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "instance_id": iid,
        "tenant_id": "00000000-0000-7000-8000-0000000000bb",
        "project_id": PROJECT,
        "name": name,
        "app_slug": slug,
        "app_version": "1.0.0",
        "manifest_id": "00000000-0000-7000-8000-0000000000cc",
        "artifact_digest": "sha256:" + "a" * 64,
        "status": "running",
        "status_changed_at": "2026-11-24T12:00:00Z",
        "placement_intent": {"mode": "launch" if workload else "same_node"},
        "config": {},
        "runtime_detail": {"workload": workload} if workload else {},
        "health": {"status": "healthy"},
        "failure_reason": None,
        "decommission": None,
        "desired_manifest_id": None,
        "desired_app_version": None,
        "previous_manifest_id": None,
        "version": 3,
        "created_at": "2026-11-24T12:00:00Z",
    }


INSTANCES = [
    instance(LAB, "my-lab", "jupyter", {"port": 8888, "health_path": "/api", "open_path": f"/apps/{LAB}/"}),
    instance(SLURM, "cluster", "slurm-reference", None),
]
DAILY = {
    "tenant_id": "00000000-0000-7000-8000-0000000000bb",
    "project_id": PROJECT,
    "period_start": "2026-11-01T00:00:00Z",
    "period_end": "2026-12-01T00:00:00Z",
    "days": [
        {"day": "2026-11-03", "currency": "USD", "gpu_amount": "5.000000", "app_amount": "0", "amount": "5.000000"},
        {"day": "2026-11-05", "currency": "USD", "gpu_amount": "2.5", "app_amount": "0.000702", "amount": "2.500702"},
    ],
    "budgets": [
        {"budget_id": PROJECT, "name": "monthly", "project_id": PROJECT, "limit_amount": "10", "currency": "USD"}
    ],
}


@pytest.fixture
def platform() -> Iterator[tuple[str, list[str]]]:
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            path = urlsplit(self.path).path
            data: Any
            if path == "/api/app-runtime/instances":
                data = {"items": INSTANCES}
            elif path.startswith("/api/app-runtime/instances/"):
                data = next(i for i in INSTANCES if i["instance_id"] == path.rsplit("/", 1)[-1])
            elif path == "/api/billing/costs/daily":
                data = DAILY
            elif path == "/api/identity/me":
                data = {"user_id": PROJECT, "email": "a@b.c", "display_name": "A", "tenant_id": None}
                data |= {"status": "active", "email_verified": True, "memberships": []}
            elif path == "/api/identity/tenants":
                data = []
            else:
                self.send_error(404)
                return
            body = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPUAAS_CONFIG", str(tmp_path / "cfg" / "config.json"))
    monkeypatch.delenv("GPUAAS_URL", raising=False)
    monkeypatch.delenv("GPUAAS_PROJECT", raising=False)
    Config(access_token="the-session-token").save()
    return tmp_path


def test_open_prints_the_url_and_hands_the_browser_the_token(
    platform: tuple[str, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = platform
    opened = tmp_path / "opened.txt"
    browser = tmp_path / "browser.py"
    browser.write_text(f"import sys, pathlib\npathlib.Path({str(opened)!r}).write_text(sys.argv[1])\n")
    monkeypatch.setenv("BROWSER", f"{sys.executable} {browser} %s")
    monkeypatch.setattr(webbrowser, "_tryorder", None)  # read BROWSER again
    result = CliRunner().invoke(app, ["--url", url, "--project", PROJECT, "apps", "open", "my-lab"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"{url}/apps/{LAB}/"
    assert "the-session-token" not in result.output
    handed = urlsplit(opened.read_text())
    assert f"{handed.scheme}://{handed.netloc}{handed.path}" == f"{url}/apps/{LAB}/"
    assert parse_qs(handed.query) == {"access_token": ["the-session-token"]}
    # --no-browser, --json, a short id: the same URL, nothing opened
    opened.unlink()
    result = CliRunner().invoke(
        app, ["--url", url, "--project", PROJECT, "--json", "apps", "open", LAB[:16], "--no-browser"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) | {} == {
        "instance_id": LAB,
        "name": "my-lab",
        "status": "running",
        "url": f"{url}/apps/{LAB}/",
        "opened": False,
    }
    assert not opened.exists()


def test_open_refuses_what_is_not_launchable_and_what_is_ambiguous(platform: tuple[str, list[str]]) -> None:
    url, _ = platform
    result = CliRunner().invoke(app, ["--url", url, "--project", PROJECT, "apps", "open", "cluster", "--no-browser"])
    assert result.exit_code == 1 and "not_launchable" in result.output
    result = CliRunner().invoke(app, ["--url", url, "--project", PROJECT, "apps", "open", "019ab8c4", "--no-browser"])
    assert result.exit_code == 1 and "ambiguous_reference" in result.output
    assert "my-lab" in result.output and "cluster" in result.output


def test_cost_by_day_prints_the_series_with_its_currency(platform: tuple[str, list[str]]) -> None:
    url, seen = platform
    result = CliRunner().invoke(
        app, ["--url", url, "--project", PROJECT, "cost", "--by", "day", "--period", "2026-11"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert "2026-11-03" in out and "2026-11-05" in out
    assert "5.00 USD" in out and "2.500702 USD" in out and "0.000702 USD" in out
    assert "7.500702 USD" in out  # the running total, and the period total
    assert "Period total: 7.500702 USD" in out
    assert "Budget monthly: 7.500702 USD of 10.00 USD (75%)" in out
    assert any(p.startswith("/api/billing/costs/daily?") and "period=2026-11" in p for p in seen)
    js = CliRunner().invoke(app, ["--url", url, "--project", PROJECT, "--json", "cost", "--by", "day"])
    assert json.loads(js.output)["days"] == DAILY["days"]
