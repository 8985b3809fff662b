"""The typed calls the CLI makes: each builds its request (method, path, query, body, Idempotency-Key) and
answers the generated model. Run against an httpx MockTransport that records requests and answers canned
API JSON."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from gpuaas.sdk import ApiError, Client
from gpuaas.sdk.models import (
    Allocation,
    AllocationStatus,
    AllocationTimelineEntry,
    Costs,
    Manifest,
    Me,
    RuntimeOption,
    SshGrant,
    SshKey,
    Volume,
)

T = "2024-05-01T12:00:00.123456Z"
ID = str(uuid.UUID(int=1, version=4))
ALLOCATION = {
    "allocation_id": ID,
    "tenant_id": ID,
    "project_id": ID,
    "shape": "gpu_slice",
    "gpu_model": "H100-80GB",
    "gpu_count": 1,
    "status": "active",
    "status_changed_at": T,
    "requested_at": T,
    "version": 1,
    "after_release": "nothing persists",
    "added_later": {"kept": True},
}
ENTRY = {"seq": 1, "entry_id": ID, "phase": "boot", "status": "done", "message": "", "task_id": None}
ENTRY |= {"started_at": T, "finished_at": None}
KEY = {"key_id": ID, "name": "laptop", "public_key": "ssh-ed25519 AAAA", "fingerprint": "SHA256:x", "created_at": T}
GRANT = {"grant_id": ID, "allocation_id": ID, "tenant_id": ID, "project_id": ID, "public_key": "k", "fingerprint": "f"}
GRANT |= {"created_at": T, "version": 1}
VOLUME = {"volume_id": ID, "tenant_id": ID, "project_id": ID, "name": "data", "size_gb": 10, "persist": True}
VOLUME |= {"version": 1, "after_release": "kept"}
MANIFEST = {
    "manifest_id": ID,
    "slug": "slurm",
    "display_name": "Slurm",
    "description": "",
    "version": "1.0",
    "runtime_version": None,
    "artifact_kind": "oci",
    "artifact_ref": "r@sha256:0",
    "artifact_id": None,
    "artifact_state": "active",
    "compatibility": {},
    "runtime_profile": None,
    "inputs": {},
    "roles": [{"key": "worker"}],
    "active": True,
    "deprecated": False,
    "revision": 1,
    "created_at": T,
    "updated_at": T,
}
COSTS = {"tenant_id": ID, "period_start": T, "period_end": T, "totals": [], "projects": []}
ME = {"user_id": ID, "email": "a@b.example", "display_name": "", "tenant_id": None, "status": "active"}
ME |= {"email_verified": True, "memberships": []}


class Recorder:
    def __init__(self, answer: Any, status: int = 200) -> None:
        self.answer, self.status = answer, status
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return httpx.Response(self.status, json=self.answer) if self.answer is not None else httpx.Response(204)

    @property
    def last(self) -> tuple[str, str, dict[str, str], Any, str | None]:
        r = self.requests[-1]
        body = json.loads(r.content) if r.content and r.headers.get("content-type") == "application/json" else None
        return r.method, r.url.path, dict(r.url.params), body, r.headers.get("idempotency-key")


Call = Callable[[Client], Awaitable[Any]]
CASES: list[tuple[str, Call, Any, tuple[str, str, dict[str, str], Any, str | None], type | None]] = [
    (
        "create allocation",
        lambda c: c.create_allocation("p1", name="ws", gpu_model="H100-80GB", gpu_count=2, idempotency_key="k"),
        ALLOCATION,
        (
            "POST",
            "/api/allocations/projects/p1/allocations",
            {},
            {"name": "ws", "shape": "gpu_slice", "gpu_model": "H100-80GB", "gpu_count": 2, "host_class": None}
            | {"volume_ids": []},
            "k",
        ),
        Allocation,
    ),
    (
        "create allocation on a runtime",
        lambda c: c.create_allocation("p1", gpu_model="H100-80GB", gpu_count=1, runtime="gpuaas-scipy@1.0.0"),
        ALLOCATION,
        (
            "POST",
            "/api/allocations/projects/p1/allocations",
            {},
            {"name": "", "shape": "gpu_slice", "gpu_model": "H100-80GB", "gpu_count": 1, "host_class": None}
            | {"volume_ids": [], "runtime": "gpuaas-scipy@1.0.0"},
            None,
        ),
        Allocation,
    ),
    (
        "runtimes offered to a project",
        lambda c: c.runtimes("p1"),
        [
            {
                "slug": "gpuaas-base",
                "version": "1.0.0",
                "image": "r/runtimes/gpuaas-base@sha256:1",
                "digest": "sha256:1",
            }
            | {"display_name": "GPUaaS base", "state": "active"}
        ],
        ("GET", "/api/allocations/runtimes", {"project_id": "p1"}, None, None),
        RuntimeOption,
    ),
    (
        "list allocations",
        lambda c: c.allocations("p1", include_released=True),
        [ALLOCATION],
        ("GET", "/api/allocations/projects/p1/allocations", {"include_released": "true"}, None, None),
        Allocation,
    ),
    (
        "timeline after",
        lambda c: c.allocation_timeline("a1", after=3),
        [ENTRY],
        ("GET", "/api/allocations/allocations/a1/timeline", {"after": "3"}, None, None),
        AllocationTimelineEntry,
    ),
    (
        "whole timeline",
        lambda c: c.allocation_timeline("a1"),
        [ENTRY],
        ("GET", "/api/allocations/allocations/a1/timeline", {}, None, None),
        AllocationTimelineEntry,
    ),
    (
        "resize",
        lambda c: c.resize_allocation("a1", 4, idempotency_key="k"),
        ALLOCATION,
        ("POST", "/api/allocations/allocations/a1/resize", {}, {"gpu_count": 4}, "k"),
        Allocation,
    ),
    (
        "retry release",
        lambda c: c.retry_release_allocation("a1"),
        ALLOCATION,
        ("POST", "/api/allocations/allocations/a1/retry-release", {}, {}, None),
        Allocation,
    ),
    (
        "add key",
        lambda c: c.add_ssh_key("laptop", "ssh-ed25519 AAAA", idempotency_key="k"),
        KEY,
        ("POST", "/api/allocations/ssh-keys", {}, {"name": "laptop", "public_key": "ssh-ed25519 AAAA"}, "k"),
        SshKey,
    ),
    (
        "delete key",
        lambda c: c.delete_ssh_key("k1"),
        None,
        ("DELETE", "/api/allocations/ssh-keys/k1", {}, None, None),
        None,
    ),
    (
        "grant",
        lambda c: c.grant_ssh("a1", "u1", "k"),
        GRANT,
        ("POST", "/api/allocations/allocations/a1/ssh-grants", {}, {"user_id": "u1", "public_key": "k"}, None),
        SshGrant,
    ),
    (
        "revoke",
        lambda c: c.revoke_ssh_grant("a1", "g1"),
        GRANT,
        ("DELETE", "/api/allocations/allocations/a1/ssh-grants/g1", {}, None, None),
        SshGrant,
    ),
    (
        "create volume",
        lambda c: c.create_volume("p1", name="data", size_gb=10),
        VOLUME,
        (
            "POST",
            "/api/allocations/projects/p1/volumes",
            {},
            {"name": "data", "size_gb": 10, "persist": True, "access_mode": "single_writer"},
            None,
        ),
        Volume,
    ),
    (
        "apps of a tenant",
        lambda c: c.apps(tenant_id="t1"),
        [MANIFEST],
        ("GET", "/api/catalog/apps", {"tenant_id": "t1"}, None, None),
        Manifest,
    ),
    (
        "app versions",
        lambda c: c.app_versions("slurm"),
        [MANIFEST],
        ("GET", "/api/catalog/apps/slurm", {}, None, None),
        Manifest,
    ),
    ("manifest", lambda c: c.manifest("m1"), MANIFEST, ("GET", "/api/catalog/manifests/m1", {}, None, None), Manifest),
    (
        "costs",
        lambda c: c.costs(project_id="p1", period="2024-05"),
        COSTS,
        ("GET", "/api/billing/costs", {"project_id": "p1", "period": "2024-05"}, None, None),
        Costs,
    ),
    ("me", lambda c: c.me(), ME, ("GET", "/api/identity/me", {}, None, None), Me),
    (
        "create a project admin",
        lambda c: c.create_user("t1", "a@b.example", "correct-horse-battery", role="project_admin", project_id="p1"),
        {"user_id": ID},
        (
            "POST",
            "/api/identity/tenants/t1/users",
            {},
            {
                "email": "a@b.example",
                "password": "correct-horse-battery",
                "display_name": "",
                "role": "project_admin",
                "project_id": "p1",
            },
            None,
        ),
        dict,
    ),
    (
        "add a project member",
        lambda c: c.add_project_member("p1", "u1", "project_member"),
        {"membership_id": ID},
        ("POST", "/api/identity/projects/p1/members", {}, {"user_id": "u1", "role": "project_member"}, None),
        dict,
    ),
]


@pytest.mark.parametrize(("case", "call", "answer", "request_", "model"), CASES, ids=[c[0] for c in CASES])
async def test_typed_call(case: str, call: Call, answer: Any, request_: tuple[Any, ...], model: type | None) -> None:
    recorder = Recorder(answer)
    async with Client("http://platform", token="t", transport=httpx.MockTransport(recorder)) as c:
        result = await call(c)
    assert recorder.last == request_
    assert recorder.requests[-1].headers["authorization"] == "Bearer t"
    if model is None:
        assert result is None
    else:
        for item in result if isinstance(result, list) else [result]:
            assert isinstance(item, model)


async def test_a_model_dumps_back_what_the_api_answered() -> None:
    """Unknown fields are kept, so `--json` prints everything (and a newer platform breaks nothing)."""
    async with Client("http://platform", transport=httpx.MockTransport(Recorder(ALLOCATION))) as c:
        a = await c.allocation("a1")
    assert a.status is AllocationStatus.active
    dumped = a.model_dump(mode="json")
    assert {k: dumped[k] for k in ALLOCATION} == ALLOCATION


async def test_discovery_and_token_grants_go_without_the_bearer() -> None:
    token = {"access_token": "new", "token_type": "bearer", "expires_in": 60}
    recorder = Recorder(token)
    async with Client("http://platform", token="old", transport=httpx.MockTransport(recorder)) as c:
        answer = await c.token_grant("refresh_token", refresh_token="r")
        assert (answer.access_token, answer.refresh_token, c.token) == ("new", None, "old")
    request = recorder.requests[-1]
    assert "authorization" not in request.headers
    assert request.content == b"grant_type=refresh_token&refresh_token=r"


async def test_a_problem_is_raised_with_its_code() -> None:
    problem = {"title": "Not Found", "status": 404, "detail": "no such volume", "code": "not_found"}
    async with Client("http://platform", transport=httpx.MockTransport(Recorder(problem, 404))) as c:
        with pytest.raises(ApiError) as caught:
            await c.delete_volume("v1")
    assert (caught.value.status, caught.value.code) == (404, "not_found")
