"""The shipped nginx edge (deploy/nginx/gpuaas-edge.conf.template), run for real in front of identity and the
Python gateway: the Debian nginx (`/usr/sbin/nginx`, package nginx-light) with the config scripts/render_edge.py
renders for loopback ports, on a devstack Stack of identity and the gateway (as bench/gateway.py starts them).

Through the edge: identity's health probe, a password login and `GET /me` with its token (the /api/identity
prefix stripped), a correlation id on every answer (the caller's when valid, else nginx's request id, the same
one sent upstream), `/docs` and `/openapi.json` from the Python gateway behind it, an unknown service refused, and
an oversize body refused by the edge itself with 413 problem+json before any service reads it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from gpuaas.devstack.infra import free_port
from gpuaas.devstack.pytest_plugin import run_stack
from gpuaas.devstack.stack import Stack
from gpuaas.kit.settings import ServiceSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from render_edge import edge_values, render

NGINX = "/usr/sbin/nginx"
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not Path(NGINX).exists(), reason="/usr/sbin/nginx is not installed (Debian nginx-light, in APT_PACKAGES)"
    ),
]
# Under the services' own limit (1 000 000 bytes), so that a 413 for a body between the two is the edge's own.
MAX_BODY = 100_000


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    yield from run_stack(request, "gpuaas-test-edge-", services=("identity",), agents=())


@contextmanager
def running_edge(stack: Stack, rate_per_s: int = 1000, burst: int = 1000) -> Iterator[str]:
    """nginx with the rendered edge config in front of the stack's identity and gateway; yields its URL."""
    workdir = Path(tempfile.mkdtemp(prefix="gpuaas-test-nginx-"))
    port = free_port()
    conf = workdir / "nginx.conf"
    conf.write_text(
        render(
            edge_values(
                gateway=f"{stack.host}:{stack.ports['gateway']}",
                upstreams={"identity": f"{stack.host}:{stack.ports['identity']}"},
                listen=f"127.0.0.1:{port}",
                state_dir=str(workdir),
                max_body_bytes=MAX_BODY,
                rate_per_s=rate_per_s,
                burst=burst,
            )
        )
    )
    check = subprocess.run([NGINX, "-t", "-e", "stderr", "-p", str(workdir), "-c", str(conf)], capture_output=True)
    assert check.returncode == 0, check.stderr.decode()
    with open(workdir / "nginx.log", "wb") as log:
        proc = subprocess.Popen(
            [NGINX, "-e", "stderr", "-p", str(workdir), "-c", str(conf), "-g", "daemon off;"],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (workdir / "nginx.log").read_text()
            assert time.monotonic() < deadline, "nginx did not answer /healthz in 10 s"
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGQUIT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def edge(stack: Stack) -> Iterator[str]:
    with running_edge(stack) as url:
        yield url


def test_identity_health_login_and_me_through_the_edge(stack: Stack, edge: str) -> None:
    with httpx.Client(base_url=edge, timeout=10) as c:
        health = c.get("/api/identity/healthz")
        assert health.status_code == 200, health.text
        assert health.headers["x-correlation-id"]  # nginx's $request_id: the caller sent none

        email, password = stack.admin_login
        login = c.post(
            "/api/identity/auth/token",
            data={"grant_type": "password", "username": email, "password": password},
            headers={"X-Correlation-ID": "edge-test-login-1"},
        )
        assert login.status_code == 200, login.text
        assert login.headers["x-correlation-id"] == "edge-test-login-1"
        assert login.headers.get_list("x-correlation-id") == ["edge-test-login-1"]  # one, not identity's copy too
        token = login.json()["access_token"]

        me = c.get("/api/identity/me", headers={"Authorization": f"Bearer {token}"})
        assert me.status_code == 200, me.text
        assert me.json()["email"] == email

        anonymous = c.get("/api/identity/me")
        assert anonymous.status_code == 401  # identity verifies the token itself: the edge checks none

        bad_cid = c.get("/api/identity/healthz", headers={"X-Correlation-ID": "no spaces allowed"})
        assert bad_cid.headers["x-correlation-id"] not in ("", "no spaces allowed")


def test_the_rendered_default_body_limit_is_the_services() -> None:
    assert edge_values(gateway="gw:8080", upstreams={})["EDGE_MAX_BODY_BYTES"] == str(
        ServiceSettings.model_fields["max_request_bytes"].default
    )


def test_docs_and_console_come_from_the_python_gateway(edge: str) -> None:
    with httpx.Client(base_url=edge, timeout=10) as c:
        docs = c.get("/docs")
        assert docs.status_code == 200, docs.text
        assert "swagger" in docs.text.lower()
        spec = c.get("/openapi.json")
        assert spec.status_code == 200
        assert any(p.startswith("/api/identity/") for p in spec.json()["paths"])  # the gateway's merged document


def test_unknown_service_and_oversize_body_are_refused_at_the_edge(edge: str) -> None:
    with httpx.Client(base_url=edge, timeout=10) as c:
        unknown = c.get("/api/nope/healthz")
        assert unknown.status_code == 404
        assert unknown.json()["code"] == "unknown_service"

        # identity would take this body (it is under identity's limit) and answer 400: the edge refuses it first.
        big = c.post(
            "/api/identity/auth/token",
            content=b"x" * (MAX_BODY + 1),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert big.status_code == 413, big.text
        assert big.headers["content-type"].startswith("application/problem+json")
        assert big.json()["code"] == "payload_too_large"
        assert big.json()["detail"] == f"The request body exceeds {MAX_BODY} bytes."
        assert big.headers["x-correlation-id"]

        # A service that is not running behind the edge: nginx's own 502, as problem+json.
        down = c.get("/api/billing/healthz")
        assert down.status_code == 502
        assert down.json()["code"] == "upstream_unavailable"


def test_the_rate_limit_per_address_answers_429(stack: Stack) -> None:
    with running_edge(stack, rate_per_s=1, burst=2) as url, httpx.Client(base_url=url, timeout=10) as c:
        statuses = [c.get("/api/identity/healthz") for _ in range(6)]
    assert [r.status_code for r in statuses[:3]] == [200, 200, 200]  # the first, then a burst of 2
    limited = [r for r in statuses if r.status_code == 429]
    assert len(limited) >= 2, [r.status_code for r in statuses]
    assert limited[0].json()["code"] == "rate_limited"
    assert limited[0].headers["retry-after"] == "1"
    assert limited[0].headers["x-correlation-id"]
