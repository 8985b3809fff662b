"""A validation problem names every refused field and why: the rendering of each shape the services answer,
and a real request refused by the kit's own error handlers (the ones every service installs) read back by the
CLI as a process would print it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import pytest
import uvicorn
from fastapi import FastAPI, Query
from pydantic import EmailStr
from typer.testing import CliRunner

from gpuaas.cli.main import app
from gpuaas.cli.problems import field_errors, render
from gpuaas.kit.errors import install_error_handlers


def test_request_validation_names_the_field_its_source_and_the_reason() -> None:
    problem = {
        "detail": "The request failed validation.",
        "code": "validation_error",
        "errors": [
            {"loc": ["query", "email"], "msg": "value is not a valid email address", "type": "value_error"},
            {"loc": ["body", "volumes", 0, "size_gb"], "msg": "Input should be greater than 0", "type": "gt"},
            {"loc": ["body"], "msg": "Field required", "type": "missing"},
        ],
    }
    assert render(422, problem) == [
        "The request failed validation. (validation_error, HTTP 422)",
        "  email (query): value is not a valid email address",
        "  volumes[0].size_gb (body): Input should be greater than 0",
        "  the request body: Field required",
    ]


def test_app_inputs_and_rfc9457_invalid_params_name_their_fields_too() -> None:
    inputs = {"errors": [{"path": ["workers", 1], "message": "5 is greater than the maximum of 4"}, {"path": []}]}
    assert field_errors(inputs) == [("workers[1]", "5 is greater than the maximum of 4"), ("(the whole value)", "")]
    params = {"invalid_params": [{"name": "age", "reason": "must be a positive integer"}]}
    assert field_errors(params) == [("age", "must be a positive integer")]


def test_a_problem_without_fields_is_one_line() -> None:
    assert render(403, {"detail": "You may not.", "code": "forbidden"}) == ["You may not. (forbidden, HTTP 403)"]
    assert render(500, {"title": "Internal error", "errors": "not a list"}) == ["Internal error (unknown, HTTP 500)"]


@pytest.fixture
def discovery_url() -> Iterator[str]:
    """identity's discovery route as declared (an `EmailStr` query parameter) behind the kit's error handlers,
    served on loopback: the 422 body is the one every service answers."""
    api = FastAPI()
    install_error_handlers(api)

    @api.get("/api/identity/auth/discover")
    async def discover(email: Annotated[EmailStr, Query()]) -> dict[str, str]:
        return {"account_type": "personal"}

    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_login_with_a_refused_email_says_which_field_and_why(
    discovery_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUAAS_CONFIG", f"{tmp_path}/config.json")
    result = CliRunner().invoke(app, ["--url", discovery_url, "login", "--email", "someone@corp.local"])
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert lines[0] == "error: The request failed validation. (validation_error, HTTP 422)", result.output
    assert lines[1].startswith("  email (query): value is not a valid email address: "), result.output
    assert "special-use or reserved name" in lines[1], result.output
