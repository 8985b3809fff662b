"""The permission matrix, generated: every operation of every service (the gateway's aggregated
/openapi.json) x every role (+ a user of another tenant), expected 2xx/403/404 derived from
`gpuaas.kit.iam.PERMISSIONS` and the operation's `x-gpuaas-action`.

The table cannot check itself: for the high-risk operations (operator-only actions, tenant admin vs
project admin vs member vs viewer on service-account secrets, memberships, quotas, budgets, statements)
`PINNED` writes the expected answers out by hand, and those are what the matrix checks them against.

Data-driven: an operation whose path has only `{tenant_id}`/`{project_id}` parameters and no body
needs nothing here. Anything else gets one `Row` in `ROWS` (how to fill its body and other path
parameters, or why it is exempt). `test_every_operation_is_covered` names the operations that have
neither, so a new endpoint cannot silently escape the matrix.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from gpuaas.contracts.enums import Role
from gpuaas.devstack.stack import Stack
from gpuaas.kit.iam import ACTION_EXTENSION, PERMISSIONS

ROLES = ("platform_admin", "tenant_admin", "project_admin", "project_member", "viewer", "other_tenant")
PASSWORD = "matrix-password-1"
SIMPLE_PARAMS = {"tenant_id", "project_id"}


@dataclass
class World:
    tenant_id: str
    project_id: str
    tokens: dict[str, dict[str, str]]
    op: httpx.AsyncClient
    user_ids: dict[str, str] = field(default_factory=dict)

    def unique(self) -> str:
        return uuid.uuid4().hex[:10]


Setup = Callable[[World], Awaitable[dict[str, str]]]


@dataclass
class Row:
    """How to call one operation. `exempt` says why it is outside the role matrix (tested elsewhere)."""

    body: Callable[[World], dict[str, Any]] | None = None
    setup: Setup | None = None  # fills path parameters other than tenant_id/project_id, per call
    target: str | None = None  # platform | tenant | project; default: from the path parameters
    expect: Callable[[str], str] | None = None  # role -> "2xx"/"403"/"404", for non-table rules
    exempt: str | None = None
    params: Callable[[World], dict[str, str]] | None = None  # query parameters the operation requires
    query: frozenset[str] = frozenset()  # required tenant_id/project_id query parameters (derived)


async def _fresh_membership(w: World) -> dict[str, str]:
    email = f"mx-{w.unique()}@matrix.example.com"
    r = await w.op.post(
        f"/api/identity/tenants/{w.tenant_id}/users", json={"email": email, "password": PASSWORD, "role": None}
    )
    uid = r.json()["user_id"]
    m = await w.op.post(f"/api/identity/projects/{w.project_id}/members", json={"user_id": uid, "role": "viewer"})
    return {"membership_id": m.json()["membership_id"]}


async def _fresh_tenant_user(w: World) -> dict[str, str]:
    email = f"mx-{w.unique()}@matrix.example.com"
    r = await w.op.post(
        f"/api/identity/tenants/{w.tenant_id}/users", json={"email": email, "password": PASSWORD, "role": None}
    )
    return {"user_id": r.json()["user_id"]}


async def _fresh_service_account(w: World) -> dict[str, str]:
    r = await w.op.post(
        f"/api/identity/projects/{w.project_id}/service-accounts", json={"name": f"sa-{w.unique()}", "scopes": ["read"]}
    )
    return {"service_account_id": r.json()["service_account_id"]}


async def _fresh_platform_user(w: World) -> dict[str, str]:
    r = await w.op.post(
        "/api/identity/users", json={"email": f"pu-{w.unique()}@matrix.example.com", "password": PASSWORD}
    )
    return {"platform_user_id": r.json()["user_id"]}


async def _const(values: dict[str, str]) -> dict[str, str]:
    return values


def _self_service(role: str) -> str:
    return "2xx"


AUTH = "public OAuth/OIDC endpoint; covered by services/identity/tests and test_identity_sso.py"

# (METHOD, gateway path) -> Row. Other engineers: add a row for each new endpoint that needs one.
ROWS: dict[tuple[str, str], Row] = {
    ("GET", "/api/identity/.well-known/jwks.json"): Row(exempt=AUTH),
    ("GET", "/api/identity/.well-known/openid-configuration"): Row(exempt=AUTH),
    ("POST", "/api/identity/auth/token"): Row(exempt=AUTH),
    ("POST", "/api/identity/auth/logout"): Row(exempt=AUTH),
    ("GET", "/api/identity/auth/discover"): Row(exempt=AUTH),
    ("GET", "/api/identity/auth/sso/start"): Row(exempt=AUTH),
    ("GET", "/api/identity/auth/sso/callback"): Row(exempt=AUTH),
    ("GET", "/api/identity/oauth/authorize"): Row(exempt=AUTH),
    ("POST", "/api/identity/oauth/authorize"): Row(exempt=AUTH),
    ("GET", "/api/identity/oauth/userinfo"): Row(expect=_self_service),
    ("GET", "/api/identity/me"): Row(expect=_self_service),
    ("GET", "/api/identity/sessions"): Row(expect=_self_service),
    ("DELETE", "/api/identity/sessions/{session_id}"): Row(exempt="own sessions only; test_auth.py"),
    ("GET", "/api/identity/tenants"): Row(expect=_self_service),
    ("GET", "/api/identity/tenants/{tenant_id}/projects"): Row(
        expect=lambda role: "404" if role == "other_tenant" else "2xx"
    ),
    ("POST", "/api/identity/tenants"): Row(body=lambda w: {"slug": f"mx-{w.unique()}", "name": "matrix"}),
    ("POST", "/api/identity/tenants/{tenant_id}/projects"): Row(body=lambda w: {"name": f"p-{w.unique()}"}),
    ("POST", "/api/identity/tenants/{tenant_id}/users"): Row(
        body=lambda w: {"email": f"u-{w.unique()}@matrix.example.com", "password": PASSWORD, "role": None}
    ),
    ("POST", "/api/identity/tenants/{tenant_id}/members"): Row(
        setup=_fresh_tenant_user, body=lambda w: {"user_id": w.user_ids["user_id"], "role": "viewer"}
    ),
    ("POST", "/api/identity/projects/{project_id}/members"): Row(
        setup=_fresh_tenant_user, body=lambda w: {"user_id": w.user_ids["user_id"], "role": "viewer"}
    ),
    ("DELETE", "/api/identity/memberships/{membership_id}"): Row(setup=_fresh_membership, target="project"),
    ("POST", "/api/identity/users"): Row(
        body=lambda w: {"email": f"pu-{w.unique()}@matrix.example.com", "password": PASSWORD}
    ),
    ("POST", "/api/identity/users/{user_id}/disable"): Row(setup=_fresh_tenant_user, target="tenant"),
    ("POST", "/api/identity/users/{user_id}/enable"): Row(setup=_fresh_tenant_user, target="tenant"),
    ("POST", "/api/identity/platform-admins"): Row(
        setup=_fresh_platform_user, body=lambda w: {"user_id": w.user_ids["platform_user_id"]}
    ),
    ("POST", "/api/identity/projects/{project_id}/service-accounts"): Row(
        body=lambda w: {"name": f"sa-{w.unique()}", "scopes": ["read"]}
    ),
    ("POST", "/api/identity/service-accounts/{service_account_id}/rotate-secret"): Row(
        setup=_fresh_service_account, target="project"
    ),
    ("POST", "/api/identity/service-accounts/{service_account_id}/disable"): Row(
        setup=_fresh_service_account, target="project"
    ),
    ("POST", "/api/identity/service-accounts/{service_account_id}/enable"): Row(
        setup=_fresh_service_account, target="project"
    ),
    ("POST", "/api/identity/tenants/{tenant_id}/identity-providers"): Row(
        body=lambda w: {
            "name": "idp",
            "issuer": "https://idp.example.com",
            "client_id": "c",
            "domains": [f"d{w.unique()}.example.com"],
        }
    ),
    ("POST", "/api/identity/tenants/{tenant_id}/identity-providers/{idp_id}/domains/{domain}/verify"): Row(
        exempt="needs a DNS TXT record on the operator's resolver; tests/security/test_federation_hardening.py"
    ),
    ("POST", "/api/identity/oauth-clients"): Row(
        body=lambda w: {"name": "rp", "redirect_uris": ["https://rp.example.com/cb"]}
    ),
    ("POST", "/api/identity/keys/rotate"): Row(body=None),
    ("GET", "/api/identity/audit"): Row(
        # tenant admins pass their tenant; operators see everything
        expect=lambda role: {"platform_admin": "2xx", "tenant_admin": "2xx", "other_tenant": "404"}.get(role, "403")
    ),
}
# billing: a tenant's combined cost is asked by tenant_id (tenant admins and operators)
ROWS[("GET", "/api/billing/costs")] = Row(
    params=lambda w: {"tenant_id": w.tenant_id},
    expect=lambda role: {"platform_admin": "2xx", "tenant_admin": "2xx", "other_tenant": "404"}.get(role, "403"),
)
# issue 21: the daily spend series has the same scope rules as /costs
ROWS[("GET", "/api/billing/costs/daily")] = Row(
    params=lambda w: {"tenant_id": w.tenant_id},
    expect=lambda role: {"platform_admin": "2xx", "tenant_admin": "2xx", "other_tenant": "404"}.get(role, "403"),
)


async def _fresh_host(w: World) -> dict[str, str]:
    r = await w.op.post("/api/allocations/hosts", json={"name": f"mx-{w.unique()}"})
    return {"host_id": r.json()["host_id"]}


async def _cordoned_host(w: World) -> dict[str, str]:
    ids = await _fresh_host(w)
    await w.op.post(f"/api/allocations/hosts/{ids['host_id']}/cordon", json={"reason": "matrix"})
    return ids


def _missing(name: str) -> Setup:
    """A path id that names nothing: for operator-only actions authorized before the lookup."""

    async def setup(w: World) -> dict[str, str]:
        return {name: str(uuid.uuid4())}

    return setup


def _operator_not_found(role: str) -> str:
    return "404" if role == "platform_admin" else "403"


def _tenant_reader(role: str) -> str:
    return "404" if role == "other_tenant" else "2xx"


async def _fresh_volume(w: World) -> dict[str, str]:
    r = await w.op.post(
        f"/api/allocations/projects/{w.project_id}/volumes", json={"name": f"v{w.unique()}", "size_gb": 1}
    )
    return {"volume_id": r.json()["volume_id"]}


async def _offered_model(w: World) -> dict[str, str]:
    """A GPU model that a (fresh, enrolling) host offers: queue settings refuse models nobody offers."""
    model = f"MX-{w.unique()}"
    gpus = [{"index": 0, "model": model, "memory_mb": 1024}]
    await w.op.post("/api/allocations/hosts", json={"name": f"mx-{w.unique()}", "gpus": gpus})
    return {"gpu_model": model}


ALLOC = "needs a running allocation on a registered agent's GPUs; test_allocations_gateway.py and test_golden_path.py"
AGENT = "authenticated by the host's node token, not a user role; test_allocations_gateway.py"
_A = "/api/allocations"
ROWS.update(
    {
        ("POST", f"{_A}/hosts"): Row(body=lambda w: {"name": f"mx-{w.unique()}"}),
        ("GET", f"{_A}/hosts/{{host_id}}"): Row(setup=_fresh_host),
        ("POST", f"{_A}/hosts/{{host_id}}/node-token"): Row(setup=_fresh_host),
        ("POST", f"{_A}/hosts/{{host_id}}/cordon"): Row(setup=_fresh_host, body=lambda w: {"reason": "matrix"}),
        ("POST", f"{_A}/hosts/{{host_id}}/drain"): Row(setup=_fresh_host, body=lambda w: {"reason": "matrix"}),
        ("POST", f"{_A}/hosts/{{host_id}}/uncordon"): Row(setup=_cordoned_host),
        ("POST", f"{_A}/hosts/{{host_id}}/re-enrol"): Row(setup=_fresh_host, body=lambda w: {"reason": "matrix"}),
        ("PUT", f"{_A}/hosts/{{host_id}}/tenancy"): Row(
            setup=_fresh_host, body=lambda w: {"shared_tenancy_allowed": True, "reason": "matrix"}
        ),
        ("PUT", f"{_A}/host-classes/{{name}}"): Row(
            setup=lambda w: _const({"name": f"mx-{w.unique()}"}), body=lambda w: {"pids_limit": 4096}
        ),
        ("GET", f"{_A}/runtimes"): Row(expect=_self_service),  # the platform's offered runtimes, to anyone signed in
        ("POST", f"{_A}/projects/{{project_id}}/allocations"): Row(exempt=ALLOC),
        ("GET", f"{_A}/allocations"): Row(expect=_self_service),  # filtered to the caller's visible projects
        ("POST", f"{_A}/projects/{{project_id}}/volumes"): Row(body=lambda w: {"name": f"v{w.unique()}", "size_gb": 1}),
        ("GET", f"{_A}/volumes/{{volume_id}}"): Row(setup=_fresh_volume, target="project"),
        ("DELETE", f"{_A}/volumes/{{volume_id}}"): Row(setup=_fresh_volume, target="project"),
        ("PUT", f"{_A}/projects/{{project_id}}/quota"): Row(body=lambda w: {"max_gpus": 8}),
        # capacity queues (issue 29)
        ("PUT", f"{_A}/tenants/{{tenant_id}}/queues/{{gpu_model}}"): Row(
            setup=_offered_model, body=lambda w: {"weight": 1.0}
        ),
        ("GET", f"{_A}/tenants/{{tenant_id}}/queues/{{gpu_model}}"): Row(
            setup=lambda w: _const({"gpu_model": "H100-80GB"})
        ),
        ("PUT", f"{_A}/projects/{{project_id}}/queues/{{gpu_model}}"): Row(
            setup=_offered_model, body=lambda w: {"guarantee": 0}
        ),
        ("GET", f"{_A}/queues"): Row(target="platform"),  # operators' view of every pool
        ("GET", f"{_A}/tenants/{{tenant_id}}/queues"): Row(),  # a tenant admin's queues of every pool
        ("GET", f"{_A}/queue-history"): Row(target="platform"),  # every tenant queue's share over time
        ("GET", f"{_A}/tenants/{{tenant_id}}/queue-history"): Row(),  # the tenant's and its projects' shares
        ("GET", f"{_A}/projects/{{project_id}}/queues/{{gpu_model}}"): Row(
            setup=lambda w: _const({"gpu_model": "H100-80GB"})
        ),
        ("GET", f"{_A}/ssh-keys"): Row(expect=_self_service),  # the caller's own keys
        ("POST", f"{_A}/ssh-keys"): Row(exempt="the caller's own keys (no tenant scope); test_allocations_gateway.py"),
        ("DELETE", f"{_A}/ssh-keys/{{key_id}}"): Row(exempt="own keys only; test_allocations_gateway.py"),
        ("GET", "/api/metering/usage/app"): Row(expect=_self_service),  # filtered to visible projects
        ("GET", "/api/metering/meters"): Row(expect=_self_service),  # filtered to visible projects
        ("GET", "/api/metering/usage/gpu-hours"): Row(expect=_self_service),  # filtered to visible projects
        ("POST", "/api/metering/usage/app"): Row(
            exempt="app-controller service accounts only; test_billing_proofs.py "
            "test_every_app_usage_event_posted_twice_is_charged_once"
        ),
        ("GET", "/api/metering/meters/{allocation_id}"): Row(exempt=ALLOC),
        ("GET", "/api/metering/meters/{allocation_id}/usage"): Row(exempt=ALLOC),
    }
)
for _m, _p in [
    ("GET", "/allocations/{allocation_id}"),
    ("POST", "/allocations/{allocation_id}/restart"),
    ("POST", "/allocations/{allocation_id}/resize"),
    ("DELETE", "/allocations/{allocation_id}/resize"),  # cancel a waiting resize (issue 29)
    ("POST", "/allocations/{allocation_id}/release"),
    ("POST", "/allocations/{allocation_id}/retry-release"),
    ("GET", "/allocations/{allocation_id}/timeline"),
    ("GET", "/allocations/{allocation_id}/timeline/stream"),
    ("GET", "/allocations/{allocation_id}/ssh-host-key"),
    ("POST", "/allocations/{allocation_id}/ssh-grants"),
    ("GET", "/allocations/{allocation_id}/ssh-grants"),
    ("DELETE", "/allocations/{allocation_id}/ssh-grants/{grant_id}"),
    ("POST", "/allocations/{allocation_id}/volumes"),
    ("DELETE", "/allocations/{allocation_id}/volumes/{volume_id}"),
]:
    ROWS[(_m, _A + _p)] = Row(exempt=ALLOC)
for _m, _p in [
    ("POST", "/agent/register"),
    ("POST", "/agent/heartbeat"),
    ("GET", "/agent/tasks"),
    ("POST", "/agent/tasks/{task_id}/progress"),
    ("POST", "/agent/tasks/{task_id}/complete"),
]:
    ROWS[(_m, _A + _p)] = Row(exempt=AGENT)
_C = "/api/catalog"
_TENANT = {"params": lambda w: {"tenant_id": w.tenant_id}}
ROWS.update(
    {
        ("POST", f"{_C}/artifacts"): Row(
            exempt="registers a signed OCI artifact from a registry; test_catalog_trust.py"
        ),
        ("POST", f"{_C}/admin/seed"): Row(exempt="pushes the seed artifacts to an OCI registry; test_golden_path.py"),
        ("GET", f"{_C}/artifacts/{{artifact_id}}"): Row(setup=_missing("artifact_id"), expect=_operator_not_found),
        ("GET", f"{_C}/artifacts/{{artifact_id}}/history"): Row(
            setup=_missing("artifact_id"), expect=_operator_not_found
        ),
        ("POST", f"{_C}/artifacts/{{artifact_id}}/checks"): Row(
            setup=_missing("artifact_id"), body=lambda w: {"name": "lint", "passed": True}, expect=_operator_not_found
        ),
        ("POST", f"{_C}/artifacts/{{artifact_id}}/verify"): Row(
            setup=_missing("artifact_id"), expect=_operator_not_found
        ),
        ("POST", f"{_C}/artifacts/{{artifact_id}}/transitions"): Row(
            setup=_missing("artifact_id"),
            body=lambda w: {"to": "staged", "reason": "matrix"},
            expect=_operator_not_found,
        ),
        ("GET", f"{_C}/schemas/manifest"): Row(expect=_self_service),
        ("GET", f"{_C}/schemas/launchable-profile"): Row(expect=_self_service),
        ("POST", f"{_C}/apps"): Row(
            body=lambda w: {}, expect=lambda role: "422" if role == "platform_admin" else "403"
        ),  # authorized before the manifest is validated
        ("GET", f"{_C}/apps"): Row(expect=_tenant_reader, **_TENANT),
        ("GET", f"{_C}/entitlements"): Row(expect=_tenant_reader, **_TENANT),
        ("GET", f"{_C}/apps/{{slug}}"): Row(
            setup=lambda w: _const({"slug": "mx-no-such-app"}), expect=lambda role: "404", **_TENANT
        ),  # no app is registered in this stack: 404 for all; the reader rule is GET /apps
        ("GET", f"{_C}/manifests/{{manifest_id}}"): Row(
            setup=_missing("manifest_id"), expect=lambda role: "404", **_TENANT
        ),
        ("POST", f"{_C}/apps/{{slug}}/compatibility"): Row(
            setup=lambda w: _const({"slug": "mx-no-such-app"}),
            body=lambda w: {"tenant_id": w.tenant_id, "capacity_shape": "gpu_slice", "gpu_count": 1},
            expect=lambda role: "404",  # no app is registered in this stack; the reader rule is GET /apps
        ),
        ("POST", f"{_C}/manifests/{{manifest_id}}/activate"): Row(
            setup=_missing("manifest_id"), expect=_operator_not_found
        ),
        ("POST", f"{_C}/manifests/{{manifest_id}}/deactivate"): Row(
            setup=_missing("manifest_id"), expect=_operator_not_found
        ),
        ("POST", f"{_C}/manifests/{{manifest_id}}/deprecate"): Row(
            setup=_missing("manifest_id"), body=lambda w: {"reason": "matrix"}, expect=_operator_not_found
        ),
        ("POST", f"{_C}/entitlements"): Row(
            body=lambda w: {"tenant_id": w.tenant_id, "app_slug": "mx-no-such-app"}, expect=_operator_not_found
        ),
        ("POST", f"{_C}/entitlements/{{entitlement_id}}/revoke"): Row(
            setup=_missing("entitlement_id"), expect=_operator_not_found
        ),
        ("GET", f"{_C}/snapshot/{{entity}}"): Row(setup=lambda w: _const({"entity": "manifests"})),
    }
)
INSTANCE = (
    "needs a deployed app instance (entitled app, GPU capacity, its controller); "
    "test_app_runtime_controller.py and test_golden_path.py"
)
CONTROLLER = "app-controller service accounts only (apps.controller scope); test_app_runtime_controller.py"
_R = "/api/app-runtime"
ROWS[("GET", f"{_R}/instances")] = Row(expect=_self_service)  # filtered to the caller's visible projects
ROWS[("POST", f"{_R}/projects/{{project_id}}/instances")] = Row(exempt=INSTANCE)
ROWS[("PUT", f"{_R}/projects/{{project_id}}/controllers/{{app_slug}}")] = Row(
    exempt="binds an app-controller service account to an app; test_app_runtime_controller.py"
)
for _m, _p in [
    ("GET", "/instances/{instance_id}"),
    ("GET", "/instances/{instance_id}/members"),
    ("GET", "/instances/{instance_id}/operations"),
    ("POST", "/instances/{instance_id}/operations"),
    ("GET", "/instances/{instance_id}/events"),
    ("GET", "/instances/{instance_id}/events/stream"),
    ("POST", "/instances/{instance_id}/stop"),
    ("POST", "/instances/{instance_id}/start"),
    ("POST", "/instances/{instance_id}/decommission"),
    ("POST", "/instances/{instance_id}/decommission/force"),
    ("POST", "/instances/{instance_id}/upgrade"),
    ("POST", "/instances/{instance_id}/rollback"),
    ("GET", "/instances/{instance_id}/credential"),
    ("POST", "/instances/{instance_id}/credential/rotate"),
    ("POST", "/operations/{operation_id}/retry"),
    ("POST", "/operations/{operation_id}/cancel"),
    ("POST", "/operations/{operation_id}/force-fail"),
    *(("GET", "/instances/{instance_id}/workload"), ("POST", "/instances/{instance_id}/workload/open")),
    ("GET", "/instances/{instance_id}/workload/watch"),  # launchable apps: test_jupyter.py
]:
    ROWS[(_m, _R + _p)] = Row(exempt=INSTANCE)
for _m, _p in [
    ("GET", "/controller/instances"),
    ("GET", "/controller/instances/{instance_id}/members"),
    ("GET", "/controller/operations"),
    ("POST", "/controller/operations/claim"),
    ("POST", "/controller/operations/{operation_id}/heartbeat"),
    ("POST", "/controller/operations/{operation_id}/complete"),
    ("POST", "/controller/operations/{operation_id}/fail"),
    ("POST", "/controller/operations/{operation_id}/defer"),
    ("POST", "/controller/instances/{instance_id}/operations"),
    ("PUT", "/controller/instances/{instance_id}/status"),
    ("PUT", "/controller/members/{member_id}/status"),
    ("POST", "/controller/instances/{instance_id}/events"),
    ("GET", "/controller/instances/{instance_id}/credential"),
    *(("GET", "/controller/instances/{instance_id}/state"), ("PUT", "/controller/instances/{instance_id}/state")),
]:
    ROWS[(_m, _R + _p)] = Row(exempt=CONTROLLER)
_B = "/api/billing"
ROWS.update(
    {
        ("POST", f"{_B}/prices"): Row(
            body=lambda w: {
                "unit": "gpu_hour",
                "unit_price": "0",
                "currency": "USD",
                "gpu_model": f"MX-{w.unique()}",
                "shape": "gpu_slice",
            }
        ),
        ("GET", f"{_B}/prices"): Row(expect=_self_service),  # the price book is public to the authenticated
        ("POST", f"{_B}/budgets"): Row(
            target="tenant",
            body=lambda w: {"tenant_id": w.tenant_id, "name": "mx", "limit_amount": "100", "currency": "USD"},
        ),
        ("POST", f"{_B}/statements/close"): Row(body=lambda w: {"tenant_id": w.tenant_id, "period": "2020-01"}),
        ("GET", f"{_B}/statements/{{statement_id}}"): Row(
            exempt="needs a closed statement with charges; NOT covered by any e2e test yet (GET /statements is)"
        ),
    }
)
# every service's operator surface (kit admin router)
for _svc in ("identity", "allocations", "catalog", "app-runtime", "metering", "billing"):
    ROWS[("POST", f"/api/{_svc}/admin/dead-letters/{{dead_letter_id}}/retry")] = Row(
        exempt="needs a parked event; the GET /admin endpoints carry the same platform.admin rule"
    )
    ROWS[("POST", f"/api/{_svc}/admin/outbox/replay")] = Row(body=lambda w: {"since": "2099-01-01T00:00:00Z"})


# High-risk operations: (the action the operation must declare, the answer of each principal in ROLES order)
# written out by hand, NOT derived from PERMISSIONS (the table enforcement reads). A change to the table
# that moves one of these fails here until this is changed deliberately too.
PLATFORM_ONLY = "2xx 403 403 403 403 403"
PINNED: dict[tuple[str, str], tuple[str, str]] = {
    ("POST", "/api/identity/tenants"): ("identity.tenant.create", PLATFORM_ONLY),
    ("POST", "/api/identity/platform-admins"): ("identity.platform_admin.manage", PLATFORM_ONLY),
    ("POST", "/api/allocations/hosts"): ("allocations.host.manage", PLATFORM_ONLY),
    ("POST", "/api/billing/prices"): ("billing.price.manage", PLATFORM_ONLY),
    ("POST", "/api/billing/statements/close"): ("billing.statement.close", PLATFORM_ONLY),
    ("POST", "/api/billing/budgets"): ("billing.budget.manage", "2xx 2xx 403 403 403 404"),
    ("PUT", "/api/allocations/projects/{project_id}/quota"): ("allocations.quota.manage", "2xx 2xx 403 403 403 404"),
    ("PUT", "/api/allocations/tenants/{tenant_id}/queues/{gpu_model}"): (
        "allocations.queue.operate",
        "2xx 403 403 403 403 404",
    ),
    ("PUT", "/api/allocations/projects/{project_id}/queues/{gpu_model}"): (
        "allocations.queue.manage",
        "2xx 2xx 403 403 403 404",
    ),
    ("GET", "/api/allocations/queues"): ("allocations.queue.operate", PLATFORM_ONLY),
    ("GET", "/api/allocations/queue-history"): ("allocations.queue.operate", PLATFORM_ONLY),
    ("POST", "/api/identity/projects/{project_id}/service-accounts"): (
        "identity.service_account.manage",
        "2xx 2xx 2xx 403 403 404",
    ),
    ("POST", "/api/identity/service-accounts/{service_account_id}/rotate-secret"): (
        "identity.service_account.manage",
        "2xx 2xx 2xx 403 403 404",
    ),
    ("DELETE", "/api/identity/memberships/{membership_id}"): ("identity.member.manage", "2xx 2xx 2xx 403 403 404"),
    **{
        ("POST", f"/api/{svc}/admin/outbox/replay"): ("platform.admin", PLATFORM_ONLY)
        for svc in ("identity", "allocations", "catalog", "app-runtime", "metering", "billing")
    },
}


def pinned(method: str, path: str, role: str) -> str | None:
    """The hand-written answer of `role` for a pinned operation (None: not pinned)."""
    if (method, path) not in PINNED:
        return None
    return dict(zip(ROLES, PINNED[(method, path)][1].split(), strict=True))[role]


def test_pinned_answers_agree_with_the_permission_table() -> None:
    """Without a stack: the table still says what the pins say (and each pin is a row the matrix runs)."""
    disagree = []
    for (method, path), (action, _) in PINNED.items():
        row = ROWS.get((method, path))
        assert row is not None and not row.exempt and row.expect is None, (method, path)
        for role in ROLES:
            table = expected(action, target_of(path, row), role)
            if table != pinned(method, path, role):
                disagree.append(f"{role:15} {method} {path}: pinned {pinned(method, path, role)}, table {table}")
    assert not disagree, "PERMISSIONS no longer gives the pinned answers:\n" + "\n".join(disagree)


def target_of(path: str, row: Row) -> str:
    if row.target:
        return row.target
    if "{project_id}" in path or "project_id" in row.query:
        return "project"
    if "{tenant_id}" in path or "tenant_id" in row.query:
        return "tenant"
    return "platform"


def expected(action: str, target: str, role: str) -> str:
    """What gpuaas.kit.iam.authorize answers, restated from the permission table."""
    allowed = {str(r) for r in PERMISSIONS[action]}
    if role == "platform_admin":
        return "2xx" if Role.platform_admin in allowed else "403"
    if target == "platform":
        return "403" if Role.platform_admin in allowed else "2xx"
    if role == "other_tenant":
        return "404"
    if target == "tenant":
        return "2xx" if role == "tenant_admin" and Role.tenant_admin in allowed else "403"
    return "2xx" if role in allowed else "403"


def classify(status: int) -> str:
    return "2xx" if 200 <= status < 300 else str(status)


@pytest.fixture(scope="module")
async def world(stack: Stack, admin_token: str) -> AsyncIterator[World]:
    headers = {"Authorization": f"Bearer {admin_token}"}
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=headers, timeout=30) as gw:
        yield await _world(gw)


async def _world(gw: httpx.AsyncClient) -> World:
    slug = f"mx-{uuid.uuid4().hex[:6]}"
    tid = (await gw.post("/api/identity/tenants", json={"slug": slug, "name": slug})).json()["tenant_id"]
    pid = (await gw.post(f"/api/identity/tenants/{tid}/projects", json={"name": "p"})).json()["project_id"]
    oslug = f"mxo-{uuid.uuid4().hex[:6]}"
    otid = (await gw.post("/api/identity/tenants", json={"slug": oslug, "name": oslug})).json()["tenant_id"]
    tokens = {"platform_admin": dict(gw.headers)}
    for role in ROLES[1:]:
        email = f"{role.replace('_', '-')}@{slug}.example.com"
        tenant = otid if role == "other_tenant" else tid
        tenant_role = "tenant_admin" if role in ("tenant_admin", "other_tenant") else None
        r = await gw.post(
            f"/api/identity/tenants/{tenant}/users", json={"email": email, "password": PASSWORD, "role": tenant_role}
        )
        assert r.status_code == 201, r.text
        if tenant_role is None:
            m = await gw.post(
                f"/api/identity/projects/{pid}/members", json={"user_id": r.json()["user_id"], "role": role}
            )
            assert m.status_code == 201, m.text
        t = await gw.post(
            "/api/identity/auth/token", data={"grant_type": "password", "username": email, "password": PASSWORD}
        )
        tokens[role] = {"Authorization": f"Bearer {t.json()['access_token']}"}
    return World(tid, pid, tokens, gw)


async def operations(gw: httpx.AsyncClient) -> list[tuple[str, str, dict[str, Any]]]:
    doc = (await gw.get("/openapi.json")).json()
    out = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method in ("get", "post", "put", "patch", "delete"):
                out.append((method.upper(), path, op))
    return out


def plan(method: str, path: str, op: dict[str, Any]) -> Row | str:
    """The row to run, or why the operation cannot be run (uncovered)."""
    row = ROWS.get((method, path))
    if row is not None:
        return row
    params = {p.strip("{}") for p in path.split("/") if p.startswith("{")}
    query = {p["name"] for p in op.get("parameters", []) if p.get("in") == "query" and p.get("required")}
    if ACTION_EXTENSION in op and params | query <= SIMPLE_PARAMS and "requestBody" not in op:
        return Row(query=frozenset(query))
    return "no row in ROWS and not derivable (body or other path parameters, or no x-gpuaas-action)"


async def call(w: World, method: str, path: str, row: Row, role: str) -> int:
    extra = await row.setup(w) if row.setup else {}
    w.user_ids.update(extra)
    url = path.replace("{tenant_id}", w.tenant_id).replace("{project_id}", w.project_id)
    for k, v in extra.items():
        url = (
            url.replace(f"{{{k}}}", v).replace("{user_id}", v) if k.endswith("user_id") else url.replace(f"{{{k}}}", v)
        )
    params = {"tenant_id": w.tenant_id} if path.endswith("/audit") and role != "platform_admin" else None
    if row.params is not None:
        params = row.params(w)
    elif row.query:
        params = {name: w.tenant_id if name == "tenant_id" else w.project_id for name in row.query}
    kwargs: dict[str, Any] = {"headers": w.tokens[role], "params": params}
    if row.body is not None:
        kwargs["json"] = row.body(w)
    for _ in range(20):
        r = await w.op.request(method, url, **kwargs)
        if r.status_code != 429:
            return r.status_code
        await asyncio.sleep(float(r.headers.get("retry-after", "1")))
    return 429


async def test_every_operation_is_covered(gw: httpx.AsyncClient) -> None:
    uncovered = [f"{m} {p}: {why}" for m, p, op in await operations(gw) if isinstance(why := plan(m, p, op), str)]
    assert not uncovered, "add these to ROWS in tests/e2e/test_identity_matrix.py:\n" + "\n".join(uncovered)


async def test_permission_matrix(gw: httpx.AsyncClient, world: World) -> None:
    cases = []
    for method, path, op in await operations(gw):
        row = plan(method, path, op)
        if isinstance(row, str) or row.exempt:
            continue
        action = op.get(ACTION_EXTENSION)
        if (method, path) in PINNED:
            assert action == PINNED[(method, path)][0], f"{method} {path} now declares {action}"
        if row.expect is None and action is None:
            continue  # reported by test_every_operation_is_covered
        for role in ROLES:
            want = pinned(method, path, role) or (
                row.expect(role) if row.expect else expected(action, target_of(path, row), role)
            )
            cases.append((method, path, row, role, want))
    assert {(m, p) for m, p, *_ in cases} >= set(PINNED), "a pinned operation is missing from the gateway's API"
    assert len(cases) >= 100

    mismatches = []
    loop = asyncio.get_running_loop()
    for method, path, row, role, want in cases:
        deadline = loop.time() + 30  # other services' projections may lag the world's setup by a moment
        while True:
            got = classify(await call(world, method, path, row, role))
            if got == want or loop.time() > deadline or got not in ("404", "403"):
                break
            await asyncio.sleep(0.3)
        if got != want:
            mismatches.append(f"{role:15} {method:6} {path}: expected {want}, got {got}")
    ops = len({(m, p) for m, p, *_ in cases})
    print(
        f"\npermission matrix: {ops} operations x {len(ROLES)} principals = {len(cases)} calls, "
        f"{len(cases) - len(mismatches)} as the table says"
    )
    assert not mismatches, "\n".join(mismatches)
