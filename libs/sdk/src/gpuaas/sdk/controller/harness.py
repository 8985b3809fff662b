"""Run a controller against a real platform in a test (Juju's `Harness`, but no fake platform): the stack
started by the devstack fixtures (`stack`, `admin_token`) or any other.

    h = Harness(stack.gateway_url, admin_token)
    team = await h.team("echo")                                    # tenant, project, admin, service account
    await h.publish(team, manifest, registry=stack_registry)       # push, register, check, promote, activate,
                                                                   # entitle
    await team.bind(manifest["slug"])
    async with h.running(EchoController(), team, manifest["slug"]) as loop:
        inst = await team.user.deploy(...)
        await h.wait(lambda: ..., "instance running")

Everything goes through the public API with real tokens: what passes here passes against a real platform.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gpuaas.sdk.client import ApiError, Client
from gpuaas.sdk.controller.handlers import Controller
from gpuaas.sdk.controller.loop import ReconcileLoop
from gpuaas.sdk.models import Manifest
from gpuaas.sdk.oci import push_artifact

T = TypeVar("T")
PASSWORD = "correct-horse-battery-staple"


@dataclass
class Team:
    """An app team's world: its tenant and project, a project admin (`user`) and the controller's service
    account (`controller`, logged in with client_credentials)."""

    tenant_id: str
    project_id: str
    user: Client
    service_account: dict[str, Any]
    controller: Client

    async def bind(self, app_slug: str) -> None:
        """Bind the service account as the app's controller (retried while the projections catch up)."""

        async def bound() -> bool:
            try:
                await self.user.bind_controller(self.project_id, app_slug, self.service_account["service_account_id"])
                return True
            except ApiError as exc:
                if exc.status >= 500 or exc.code in ("not_the_controller", "forbidden", "permission_denied"):
                    raise
                return False

        await wait(bound, "controller bound", timeout_s=60)

    async def aclose(self) -> None:
        await self.user.aclose()
        await self.controller.aclose()


async def wait(check: Callable[[], Awaitable[T]], what: str, *, timeout_s: float = 90, interval_s: float = 0.5) -> T:
    """Poll `check` until it answers something truthy; fail naming `what` after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    last: T | None = None
    while asyncio.get_running_loop().time() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})")


class Harness:
    def __init__(self, gateway_url: str, operator_token: str) -> None:
        self.url = gateway_url
        self.operator = Client(gateway_url, operator_token)
        self._clients: list[Client] = [self.operator]

    async def aclose(self) -> None:
        for c in self._clients:
            await c.aclose()

    async def team(self, name: str) -> Team:
        run = uuid.uuid4().hex[:6]
        tenant = await self.operator.create_tenant(f"{name}-{run}", name)
        tid = tenant["tenant_id"]
        pid = (await self.operator.create_project(tid, name))["project_id"]
        email = f"admin-{run}@{name}.example.com"
        created = await self.operator.create_user(tid, email, PASSWORD, role=None)
        await self.operator.add_project_member(pid, created["user_id"], "project_admin")
        user = Client(self.url)
        await user.login(email, PASSWORD)
        sa = await user.create_service_account(pid, f"{name}-ctl-{run}", ["app-controller"])
        ctl = Client(self.url)
        ctl.use_client_credentials(sa["client_id"], sa["client_secret"])
        self._clients += [user, ctl]
        return Team(tid, pid, user, sa, ctl)

    async def publish(self, team: Team, manifest: dict[str, Any], *, registry: str, package: bytes = b"") -> Manifest:
        """The whole publishing path of the guide: push the package to `registry`, register the artifact,
        record the lint and smoke checks, promote it (staged → canary for the team's tenant → active),
        register the manifest pointing at it, activate it, and entitle the team's tenant."""
        op = self.operator
        data = package or f"controller package of {manifest['slug']} {manifest['version']}".encode()
        ref = await push_artifact(registry, f"apps/{manifest['slug']}", data, tag=manifest["version"])
        artifact = await op.register_artifact(ref)
        for check in ("lint", "smoke"):
            await op.record_check(artifact.artifact_id, check, passed=True, detail="harness")
        for to in ("staged", "canary", "active"):

            async def promoted(to: str = to) -> bool:
                try:
                    await op.promote(artifact.artifact_id, to, "harness", canary_tenants=[team.tenant_id])
                    return True
                except ApiError as exc:  # the catalog learns of a new tenant through identity's events
                    if exc.status >= 500:
                        raise
                    return False

            await wait(promoted, f"artifact promoted to {to}", timeout_s=60)
        registered = await op.register_app({**manifest, "artifact_ref": ref})
        if not registered.active:
            registered = await op.activate_manifest(registered.manifest_id)
        await op.grant_entitlement(team.tenant_id, manifest["slug"])
        return registered

    @contextlib.asynccontextmanager
    async def running(
        self, controller: Controller, team: Team, app_slug: str, **loop_kw: Any
    ) -> AsyncGenerator[ReconcileLoop, None]:
        """The controller's loop in this process, as the team's service account; stopped (gracefully) on exit,
        and whatever it raised is raised here."""
        loop_kw = {"lease_s": 15, "poll_interval_s": 0.3, "watch_every_s": 0.5} | loop_kw
        loop = ReconcileLoop(team.controller, app_slug=app_slug, controller=controller, **loop_kw)
        task = asyncio.create_task(loop.run(), name=f"controller-{app_slug}")
        try:
            yield loop
        finally:
            loop.stop()
            await asyncio.wait_for(task, 60)
