"""The one harness of the suites that run a whole Stack (tests/e2e, tests/faults, tests/badinput).

Loaded from the root conftest (`pytest_plugins`). Each suite's conftest keeps only what is its own:
its `stack` fixture, started with `run_stack()` under its own directory prefix (a session per suite,
so one suite's junk never reaches another's stack). On that stack this plugin provides:

- `admin_tokens`: the seeded operator's access tokens, logged in again when one is near expiry (a
  fault run outlives the 15 minutes of an access token);
- `admin_token` (module scope): a token valid for most of its lifetime when the module starts;
- `gw`: an httpx.AsyncClient on the gateway as the operator, each request with a fresh token.

With podman installed, every such stack also runs the OCI registry with the runtime images (built once
and cached, see runtime_images) seeded in its catalog, and its node agents use the container driver.
`run_isolation_stack()` starts one that must (two container hosts by default); `runtime_registry` is its
registry (`LocalRegistry`: `.address`, `.blob_path(digest)` for tamper tests) and `stack.runtimes.pushed`
the pushed images ({slug: PushedImage(ref, digest)}).

and, for the tests themselves, `new_team` (a fresh tenant, project, admin and member) and `target_of`
(the stack as the golden path's `Target`, what `golden_path.actors` helpers such as `start_agent` take).
Waiting helpers are in `gpuaas.devstack.waiting` (`eventually`, `until_done`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from gpuaas.devstack.agents import remove_agent_containers
from gpuaas.devstack.config import StackConfig
from gpuaas.devstack.registry import LocalRegistry
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.testing import remove_root, temp_root

if TYPE_CHECKING:
    from gpuaas.devstack.golden_path.actors import Target

log = logging.getLogger("gpuaas.devstack")
# A token handed to a module-scoped fixture must outlast the module: log in again unless it has this long.
MODULE_TOKEN_MIN_VALID_S = 600.0
# A token used for one request needs only to reach the service.
REQUEST_TOKEN_MIN_VALID_S = 60.0


def run_stack(request: pytest.FixtureRequest, prefix: str, **overrides: Any) -> Generator[Stack, None, None]:
    """Start a Stack on free ports in a fresh directory (see `temp_root`) for a session fixture; stop it
    after. Its directory (logs, data) is removed unless a test failed or GPUAAS_KEEP_STACK is set.
    `GPUAAS_DATABASE_URL` / `GPUAAS_KAFKA_BOOTSTRAP` / `GPUAAS_STACK_BROKER` are honoured; with
    `GPUAAS_STACK_BROKER=testcontainers` Postgres and Apache Kafka run as containers (`container_infra`)."""
    root = temp_root(prefix)
    config = StackConfig.from_env(root=root, free_ports=True, **overrides)
    try:
        with ExitStack() as infra:  # closed before the directory goes: the podman API socket lives in it
            if config.broker == "testcontainers" and not config.database_url:
                config.database_url = container_infra(infra, root)
            stack = Stack(config)
            stack.start()
            try:
                yield stack
            finally:
                try:
                    stack.stop()
                finally:  # the stack is disposable: so are its allocations' containers, even when stopping failed
                    remove_agent_containers(root / "agents")
    finally:
        if os.environ.get("GPUAAS_KEEP_STACK") or request.session.testsfailed:
            log.warning("kept the stack's logs and data for a post-mortem: %s", root)
        else:
            remove_root(root)


def container_infra(infra: ExitStack, root: Path) -> str:
    """podman's Docker API for testcontainers, and a Postgres container (its superuser URL returned); on
    `infra`'s exit every container labelled with `root` (Postgres, the stack's Kafka) is removed and the API
    stopped. The images are built first if missing (`make infra-images`; cached)."""
    from gpuaas.devstack.containers import ROOT_LABEL, PodmanService, remove_labelled, start_postgres
    from gpuaas.devstack.infra_images import ensure_infra_images

    t0 = time.monotonic()
    ensure_infra_images()
    infra.enter_context(PodmanService(root / "podman.sock"))
    infra.callback(remove_labelled, root)
    pg = start_postgres(f"gpuaas-tc-pg-{root.name}", secrets.token_hex(12), labels={ROOT_LABEL: str(root)})
    log.info(
        "testcontainers: Postgres ready in %.1fs (%.1fs with the API and image check)",
        pg.seconds,
        time.monotonic() - t0,
    )
    return pg.url


ISOLATION_AGENTS: tuple[tuple[str, str], ...] = (("iso-host-a", "4xH100-80GB"), ("iso-host-b", "4xH100-80GB"))


def run_isolation_stack(
    request: pytest.FixtureRequest, prefix: str = "gpuaas-isolation-", **overrides: Any
) -> Iterator[Stack]:
    """`run_stack` whose agents (ISOLATION_AGENTS unless `agents=` is given) must run the container driver
    with the registry and runtime images seeded: fails at once (naming why) when they cannot."""
    overrides = {"agents": ISOLATION_AGENTS, "runtime_images": True, "agent_driver": "container", **overrides}
    stacks = run_stack(request, prefix, **overrides)
    stack = next(stacks)
    try:
        if not stack.runtimes.ready or not stack.runtimes.wait_seeded():
            why = stack.runtimes.error or stack.runtimes.seed_error
            pytest.fail(f"runtime images not available on the isolation stack: {why}")
        yield stack
    finally:
        stacks.close()  # run_stack's own cleanup: stop the stack, remove its directory


@pytest.fixture
def runtime_registry(stack: Stack) -> LocalRegistry:
    """The stack's OCI registry holding the runtime images (the stack must run them)."""
    if stack.runtimes.registry is None:
        pytest.skip("this stack runs no registry: podman or docker-registry is not installed")
    return stack.runtimes.registry


class AdminTokens:
    """The seeded platform operator's access tokens through the gateway, logged in again when near expiry."""

    def __init__(
        self, gateway_url: str, login: tuple[str, str], transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.gateway_url = gateway_url
        self.login = login
        self.transport = transport  # tests of the harness itself
        self._token: str | None = None
        self._expires_mono = 0.0
        self._issued: set[str] = set()
        self._lock = asyncio.Lock()

    def issued(self, token: str) -> bool:
        """Whether this source handed out `token` (so that a client may swap it for a fresh one)."""
        return token in self._issued

    async def token(self, min_valid_s: float = REQUEST_TOKEN_MIN_VALID_S) -> str:
        """A token valid for at least `min_valid_s` more seconds (or a fresh one)."""
        async with self._lock:
            if self._token is None or self._expires_mono - time.monotonic() < min_valid_s:
                await self._log_in()
            assert self._token is not None
            return self._token

    async def _log_in(self) -> None:
        email, password = self.login
        sent = time.monotonic()
        async with httpx.AsyncClient(base_url=self.gateway_url, timeout=30, transport=self.transport) as client:
            r = await client.post(
                "/api/identity/auth/token", data={"grant_type": "password", "username": email, "password": password}
            )
        assert r.status_code == 200, r.text
        body = r.json()
        self._token = str(body["access_token"])
        self._expires_mono = sent + float(body.get("expires_in") or 0)
        self._issued.add(self._token)


class AdminAuth(httpx.Auth):
    """Swaps the operator token a request carries for a fresh one when it is near expiry; a request
    that carries any other Authorization (a test acting as someone else) is left as it is."""

    def __init__(self, tokens: AdminTokens) -> None:
        self.tokens = tokens

    async def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, httpx.Response]:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme == "Bearer" and self.tokens.issued(token):
            request.headers["Authorization"] = f"Bearer {await self.tokens.token()}"
        yield request

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        raise RuntimeError("AdminAuth refreshes tokens asynchronously: use it with an httpx.AsyncClient")


@pytest.fixture(scope="session")
def _admin_token_sources() -> dict[str, AdminTokens]:
    # Keyed by gateway: a session that runs several suites has one stack (and operator) per suite.
    return {}


def _tokens_of(stack: Stack, sources: dict[str, AdminTokens]) -> AdminTokens:
    if stack.gateway_url not in sources:
        sources[stack.gateway_url] = AdminTokens(stack.gateway_url, stack.admin_login)
    return sources[stack.gateway_url]


@pytest.fixture
def admin_tokens(stack: Stack, _admin_token_sources: dict[str, AdminTokens]) -> AdminTokens:
    return _tokens_of(stack, _admin_token_sources)


@pytest.fixture(scope="module")
async def admin_token(stack: Stack, _admin_token_sources: dict[str, AdminTokens]) -> str:
    return await _tokens_of(stack, _admin_token_sources).token(MODULE_TOKEN_MIN_VALID_S)


@pytest.fixture
async def gw(stack: Stack, admin_tokens: AdminTokens) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {await admin_tokens.token()}"}
    async with httpx.AsyncClient(
        base_url=stack.gateway_url, headers=headers, auth=AdminAuth(admin_tokens), timeout=30
    ) as client:
        yield client


def target_of(stack: Stack) -> Target:
    """The stack as the golden path's `Target` (node agents dial allocations directly)."""
    from gpuaas.devstack.golden_path.actors import Target  # SSH and the SDK only for the tests that use them

    return Target(
        stack.gateway_url,
        stack.service_url("allocations"),
        stack.admin_login,
        stack.root,
        stack.logs_dir,
        stack.runtimes.agent_env(),
    )


@dataclass(frozen=True)
class Team:
    """A fresh tenant with one project: its admin (who logs in with `admin_email` and the password given
    to `new_team`) and one more project member."""

    run: str
    tenant_id: str
    project_id: str
    admin_email: str
    member_id: str


async def new_team(
    gw: httpx.AsyncClient, prefix: str, tenant_name: str, project: str, admin: str, member: str, password: str
) -> Team:
    """Tenant `<prefix>-<run>` ("<tenant_name> <run>") with `project`, its project admin `admin` and a
    project member `member` (emails `<name>-<run>@<prefix>-<run>.example.com`), created as the operator."""
    run = uuid.uuid4().hex[:6]
    slug = f"{prefix}-{run}"
    r = await gw.post("/api/identity/tenants", json={"slug": slug, "name": f"{tenant_name} {run}"})
    assert r.status_code == 201, r.text
    tenant_id = r.json()["tenant_id"]
    r = await gw.post(f"/api/identity/tenants/{tenant_id}/projects", json={"name": project})
    assert r.status_code == 201, r.text
    project_id = r.json()["project_id"]
    user_ids = {}
    for name, role in ((admin, "project_admin"), (member, "project_member")):
        email = f"{name}-{run}@{slug}.example.com"
        r = await gw.post(
            f"/api/identity/tenants/{tenant_id}/users", json={"email": email, "password": password, "role": None}
        )
        assert r.status_code == 201, r.text
        user_ids[name] = r.json()["user_id"]
        r = await gw.post(
            f"/api/identity/projects/{project_id}/members", json={"user_id": user_ids[name], "role": role}
        )
        assert r.status_code == 201, r.text
    return Team(run, tenant_id, project_id, f"{admin}-{run}@{slug}.example.com", user_ids[member])
