"""The CLI's own logic without a platform: endpoint resolution, config file, KEY=VALUE inputs, and how
problems and connection failures turn into messages and exit codes (against real local HTTP servers), and
the PKCE challenge `login --sso` starts with."""

from __future__ import annotations

import json
import re
import socket
import stat
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import typer
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from typer.testing import CliRunner

from gpuaas.cli import sso
from gpuaas.cli.commands.apps import parse_config
from gpuaas.cli.config import DEFAULT_URL, Config, remember_host_key, resolve_url
from gpuaas.cli.main import app


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPUAAS_CONFIG", str(tmp_path / "cfg" / "config.json"))
    monkeypatch.delenv("GPUAAS_URL", raising=False)
    monkeypatch.delenv("GPUAAS_PROJECT", raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_url_resolution_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_url(None, Config()) == DEFAULT_URL
    (tmp_path / ".local").mkdir()
    (tmp_path / ".local" / "stack.json").write_text(json.dumps({"gateway": {"url": "http://127.0.0.1:9100/"}}))
    nested = tmp_path / "a" / "b"
    nested.mkdir(parents=True)
    assert resolve_url(None, Config(), start=nested) == "http://127.0.0.1:9100"
    assert resolve_url(None, Config(url="http://cfg:1")) == "http://cfg:1"
    monkeypatch.setenv("GPUAAS_URL", "http://env:2/")
    assert resolve_url(None, Config(url="http://cfg:1")) == "http://env:2"
    assert resolve_url("http://flag:3", Config(url="http://cfg:1")) == "http://flag:3"


def test_config_file_is_private(isolated: Path) -> None:
    Config(url="http://x", access_token="secret", project_id="p").save()
    path = isolated / "cfg" / "config.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = Config.load()
    assert (loaded.url, loaded.access_token, loaded.project_id) == ("http://x", "secret", "p")


def test_pinned_host_keys_replace_an_endpoints_earlier_key_and_keep_the_others(isolated: Path) -> None:
    """`alloc ssh` writes the key the platform pinned; a re-pinned endpoint's old key must not linger (OpenSSH
    would accept either), another endpoint's key stays."""
    path = remember_host_key("[10.0.0.1]:2222 ssh-ed25519 AAAAold")
    assert path == isolated / "cfg" / "known_hosts"
    remember_host_key("[10.0.0.2]:2222 ssh-ed25519 AAAAother")
    remember_host_key("[10.0.0.1]:2222 ssh-ed25519 AAAAnew")
    assert path.read_text().splitlines() == [
        "[10.0.0.2]:2222 ssh-ed25519 AAAAother",
        "[10.0.0.1]:2222 ssh-ed25519 AAAAnew",
    ]


def test_config_pairs() -> None:
    assert parse_config(["cluster_name=demo", "nodes=3", "gpu=true", 'tags=["a"]']) == {
        "cluster_name": "demo",
        "nodes": 3,
        "gpu": True,
        "tags": ["a"],
    }
    with pytest.raises(typer.BadParameter):
        parse_config(["novalue"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def problem_server() -> Iterator[str]:
    """Answers every request with a 403 problem+json, like the platform does."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"title": "Forbidden", "status": 403, "detail": "You may not.", "code": "forbidden"})
            self.send_response(403)
            self.send_header("Content-Type", "application/problem+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_problem_becomes_a_clear_error(problem_server: str) -> None:
    Config(access_token="t").save()
    result = CliRunner().invoke(app, ["--url", problem_server, "--project", "p1", "alloc", "list"])
    assert result.exit_code == 1
    assert "error: You may not. (forbidden, HTTP 403)" in result.output


def test_unreachable_platform_exits_2() -> None:
    Config(access_token="t").save()
    result = CliRunner().invoke(app, ["--url", f"http://127.0.0.1:{_free_port()}", "--project", "p", "alloc", "list"])
    assert result.exit_code == 2
    assert "cannot reach the platform" in result.output


def test_not_signed_in_says_so(problem_server: str) -> None:
    result = CliRunner().invoke(app, ["--url", problem_server, "whoami"])
    assert result.exit_code == 1
    assert "run `gpuaas login`" in result.output


def test_sso_start_url_carries_the_s256_challenge_of_the_listeners_verifier() -> None:
    """`login --sso` binds the login code to this process: the start URL carries S256(verifier), the
    verifier itself stays in the process until the exchange."""
    with sso.LoopbackListener() as one, sso.LoopbackListener() as two:
        assert one.code_verifier != two.code_verifier
        for listener in (one, two):
            assert re.fullmatch(r"[A-Za-z0-9_-]{43,128}", listener.code_verifier)
            assert sso.s256(listener.code_verifier) == create_s256_code_challenge(listener.code_verifier)
        url = sso.start_url(
            "http://gw/api/identity/auth/sso/start?idp_id=abc",
            email="a@corp.example",
            return_to=one.redirect_uri,
            code_verifier=one.code_verifier,
        )
    query = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    assert query == {
        "idp_id": "abc",
        "email": "a@corp.example",
        "return_to": one.redirect_uri,
        "code_challenge": create_s256_code_challenge(one.code_verifier),
        "code_challenge_method": "S256",
    }
    assert one.code_verifier not in url


def test_the_cli_builds_no_request_paths() -> None:
    """Every call goes through a typed SDK method: no `/api/...` path is written in the CLI."""
    src = Path(sso.__file__).parent
    assert [str(f.relative_to(src)) for f in sorted(src.rglob("*.py")) if "/api/" in f.read_text()] == []


DIGEST = "sha256:" + "ab" * 32
ALLOC_ID = "00000000-0000-4000-8000-000000000001"
PROJECT_ID = "00000000-0000-4000-8000-000000000003"
CONTAINER_ALLOCATION = {
    "allocation_id": ALLOC_ID,
    "tenant_id": "00000000-0000-4000-8000-000000000002",
    "project_id": "00000000-0000-4000-8000-000000000003",
    "name": "ws",
    "shape": "gpu_slice",
    "gpu_model": "H100-80GB",
    "gpu_count": 1,
    "status": "active",
    "status_changed_at": "2024-05-01T12:00:00Z",
    "requested_at": "2024-05-01T12:00:00Z",
    "version": 1,
    "after_release": "nothing persists",
    "runtime": {"slug": "gpuaas-scipy", "version": "1.0.0", "image": f"r/runtimes/gpuaas-scipy@{DIGEST}"}
    | {"digest": DIGEST},
    "driver": "container",
    "limits": {"cpus": 1.5, "memory_mb": 4096, "pids": 4096},
}


@pytest.fixture
def allocation_server() -> Iterator[tuple[str, list[dict]]]:
    """A platform answering an allocation (container driver, runtime, limits), its empty timeline, and
    recording the bodies of creates and actions (a DELETE as its path)."""
    created: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, data: object) -> None:
            body = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._answer(200, [] if self.path.split("?")[0].endswith("/timeline") else CONTAINER_ALLOCATION)

        def do_POST(self) -> None:
            created.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self._answer(201, CONTAINER_ALLOCATION)

        def do_DELETE(self) -> None:
            created.append({"DELETE": self.path})
            self._answer(200, CONTAINER_ALLOCATION)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", created
    server.shutdown()
    server.server_close()


def test_show_says_what_the_allocation_runs_in(allocation_server: tuple[str, list[dict]]) -> None:
    url, _ = allocation_server
    Config(access_token="t").save()
    result = CliRunner().invoke(app, ["--url", url, "alloc", "show", ALLOC_ID], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert f"gpuaas-scipy 1.0.0 ({DIGEST})" in result.output
    assert "container" in result.output and "1.5 CPUs, 4096 MB memory, 4096 pids" in result.output
    shown = json.loads(CliRunner().invoke(app, ["--url", url, "--json", "alloc", "show", ALLOC_ID]).output)
    assert (shown["runtime"]["digest"], shown["driver"], shown["limits"]["pids"]) == (DIGEST, "container", 4096)


def test_create_sends_the_runtime_only_when_chosen(allocation_server: tuple[str, list[dict]]) -> None:
    url, created = allocation_server
    Config(access_token="t").save()
    for extra in (["--runtime", "gpuaas-scipy@1.0.0"], ["--runtime", DIGEST], []):
        result = CliRunner().invoke(app, ["--url", url, "--project", PROJECT_ID, "alloc", "create", *extra])
        assert result.exit_code == 0, result.output
    assert [c.get("runtime") for c in created] == ["gpuaas-scipy@1.0.0", DIGEST, None]
    assert "runtime" not in created[-1]


def test_create_sends_the_queue_choices_only_when_made(allocation_server: tuple[str, list[dict]]) -> None:
    url, created = allocation_server
    Config(access_token="t").save()
    for extra in (["--no-queue", "--priority", "5", "--max-wait", "60"], []):
        result = CliRunner().invoke(app, ["--url", url, "--project", PROJECT_ID, "alloc", "create", *extra])
        assert result.exit_code == 0, result.output
    assert (created[0]["queue"], created[0]["priority"], created[0]["max_wait"]) == (False, 5, 60)
    assert not {"queue", "priority", "max_wait"} & set(created[1])  # the body older platforms accept


def test_a_queued_allocation_shows_its_position_and_reason() -> None:
    from gpuaas.cli.commands.allocations import status_line
    from gpuaas.sdk.models import Allocation

    queued = {**CONTAINER_ALLOCATION, "status": "queued", "pending_reason": "no_capacity", "queue_position": 3}
    assert status_line(Allocation.model_validate(queued)) == "queued (position 3, no_capacity)"
    assert status_line(Allocation.model_validate(CONTAINER_ALLOCATION)) == "active"


def test_a_waiting_resize_is_shown_sent_only_when_chosen_and_cancelled(
    allocation_server: tuple[str, list[dict]],
) -> None:
    from gpuaas.cli.commands.allocations import status_line
    from gpuaas.sdk.models import Allocation

    waiting = {**CONTAINER_ALLOCATION, "pending_resize_gpus": 2, "pending_resize_reason": "no_capacity"}
    assert status_line(Allocation.model_validate(waiting)) == "active (resize to 2 GPUs waits: no_capacity)"
    url, sent = allocation_server
    Config(access_token="t").save()
    for args in (["resize", ALLOC_ID, "2", "--no-queue"], ["resize", ALLOC_ID, "2"], ["resize-cancel", ALLOC_ID]):
        result = CliRunner().invoke(app, ["--url", url, "alloc", *args])
        assert result.exit_code == 0, result.output
    assert sent == [
        {"gpu_count": 2, "queue": False},
        {"gpu_count": 2},  # the body older platforms accept
        {"DELETE": f"/api/allocations/allocations/{ALLOC_ID}/resize"},
    ]
