"""Schemathesis against every service's OpenAPI, through the gateway and directly: no 5xx, and every
error is application/problem+json with a stable `code`. Plus oversized bodies (413 problem+json, with
and without Content-Length) and malformed JSON on every service.

Requests are generated from each service's own /openapi.json (schemathesis: positive and negative
data), sent as the platform admin (the widest access: the deepest code paths), with a few operations
left out that would end the admin's session. Examples per operation: GPUAAS_FUZZ_EXAMPLES (default 8).
"""

from __future__ import annotations

import os
import re
import uuid
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from gpuaas.devstack.stack import SERVICES, Stack

pytestmark = pytest.mark.e2e

EXAMPLES = int(os.environ.get("GPUAAS_FUZZ_EXAMPLES", "8"))
GATEWAY_PREFIX = {s: s.replace("_", "-") for s in SERVICES}
# Operations that would revoke or rotate the credentials the run depends on.
SKIP = {
    ("POST", "/auth/logout"),
    ("DELETE", "/sessions/{session_id}"),
    ("POST", "/keys/rotate"),
    ("POST", "/admin/seed"),
}


def problem_ok(r: requests.Response) -> str | None:
    """None when the response is acceptable, else why not."""
    if r.status_code >= 500:
        return f"{r.status_code} server error: {r.text[:300]}"
    if r.status_code >= 400:
        ctype = r.headers.get("content-type") or ""
        if isinstance(ctype, list):  # schemathesis' response: every header is a list
            ctype = ctype[0] if ctype else ""
        if not ctype.startswith("application/problem+json"):
            return f"{r.status_code} not problem+json ({ctype}): {r.text[:200]}"
        try:
            body = r.json()
        except ValueError:
            return f"{r.status_code} problem+json that is not JSON: {r.text[:200]}"
        if not isinstance(body.get("code"), str) or body.get("status") != r.status_code:
            return f"{r.status_code} problem without a code/status: {body}"
    return None


def fuzz(stack: Stack, service: str, via: str, token: str) -> tuple[int, list[str]]:
    raw = httpx.get(f"{stack.service_url(service)}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(raw)
    base = stack.service_url(service) if via == "direct" else f"{stack.gateway_url}/api/{GATEWAY_PREFIX[service]}"
    headers = {"Authorization": f"Bearer {token}"}
    session = requests.Session()
    failures: list[str] = []
    sent = 0
    for result in schema.get_all_operations():
        op = result.ok()
        if (op.method.upper(), op.path) in SKIP or op.path.endswith("/stream") or op.path.endswith("/terminal"):
            continue

        @given(case=op.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def run(case: Any) -> None:
            nonlocal sent
            try:
                r = case.call(base_url=base, session=session, headers=headers, timeout=30)
            except requests.RequestException as exc:
                failures.append(f"{case.method} {case.path}: {type(exc).__name__}: {exc}")
                return
            sent += 1
            why = problem_ok(r)
            if why is not None:
                failures.append(f"{case.method} {case.formatted_path} [{via}]: {why}")

        run()
    return sent, failures


@pytest.mark.parametrize("via", ["direct", "gateway"])
@pytest.mark.parametrize("service", SERVICES)
def test_schemathesis_no_5xx_and_problem_json(stack: Stack, admin_token: str, service: str, via: str) -> None:
    sent, failures = fuzz(stack, service, via, admin_token)
    print(f"\nFUZZ {service} via {via}: {sent} requests, {len(failures)} failures")
    assert sent > 0
    assert not failures, "\n".join(sorted(set(failures))[:40])


def first_post(stack: Stack, service: str) -> str:
    """A POST route of the service (path parameters filled with a random UUID)."""
    raw = httpx.get(f"{stack.service_url(service)}/openapi.json", timeout=30).json()
    for path, ops in raw["paths"].items():
        if "post" in ops and "requestBody" in ops["post"] and "logout" not in path:
            return _fill(path)
    raise AssertionError(f"{service} has no POST route with a body")


def _fill(path: str) -> str:
    return re.sub(r"\{[^}]+\}", str(uuid.uuid4()), path)


@pytest.mark.parametrize("via", ["direct", "gateway"])
@pytest.mark.parametrize("service", SERVICES)
async def test_oversized_and_malformed_bodies(stack: Stack, admin_token: str, service: str, via: str) -> None:
    path = first_post(stack, service)
    base = stack.service_url(service) if via == "direct" else f"{stack.gateway_url}/api/{GATEWAY_PREFIX[service]}"
    h = {"Authorization": f"Bearer {admin_token}", "content-type": "application/json"}
    big = b'{"name": "' + b"x" * 3_000_000 + b'"}'

    async def chunks():  # no Content-Length: the limit must hold on the stream too
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    async with httpx.AsyncClient(base_url=base, timeout=60) as c:
        for label, kwargs in (
            ("oversized", {"content": big}),
            ("oversized-chunked", {"content": chunks()}),
        ):
            r = await c.post(path, headers=h, **kwargs)
            assert r.status_code == 413, (label, path, r.status_code, r.text[:200])
            assert r.headers["content-type"].startswith("application/problem+json"), (label, r.headers)
            assert r.json()["code"] == "payload_too_large"
        for body in (b"{", b"\xff\xfe\x00", b"[]" * 10, b'{"a":' * 500 + b"1" + b"}" * 500, b"null"):
            r = await c.post(path, headers=h, content=body)
            assert 400 <= r.status_code < 500, (path, body[:20], r.status_code, r.text[:200])
            assert r.headers["content-type"].startswith("application/problem+json"), (path, r.text[:200])
    # the service is still whole
    assert stack.is_running(service)
    async with httpx.AsyncClient(timeout=10) as c:
        assert (await c.get(f"{stack.service_url(service)}/healthz")).status_code == 200
