"""One app-runtime app per test module (real Postgres schema, real broker, served by uvicorn on a loopback
port so the SDK speaks real HTTP, SSE included). Each test seeds its own tenant through the identity,
allocations and catalog events the service consumes (applied through its own handlers)."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
import uvicorn
from sqlalchemy import text

from gpuaas.app_runtime.app import SPEC
from gpuaas.contracts import Event
from gpuaas.contracts.enums import AllocationStatus, CapacityShape, MembershipScope, Role
from gpuaas.contracts.events import allocations as al
from gpuaas.contracts.events import catalog as cat
from gpuaas.contracts.events import identity as idn
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.testing import running, service_app
from gpuaas.sdk import Client


class _Server(uvicorn.Server):
    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class Runtime:
    kit: KitRuntime
    url: str
    signer: Any

    async def apply(self, *events: Event) -> None:
        """Apply events through the service's own handlers, as its consumer would."""
        async with self.kit.sessions() as s, s.begin():
            for e in events:
                for handler in self.kit.subscriptions.handlers.get(e.type, []):
                    await handler(s, e)

    def client(self, token: str) -> Client:
        return Client(self.url, token, prefix="")

    async def outbox(self, event_type: str, subject: Any = None) -> list[dict[str, Any]]:
        import json

        sql = "SELECT payload FROM outbox WHERE event_type = :t" + (" AND aggregate_id = :s" if subject else "")
        sql += " ORDER BY seq"
        async with self.kit.sessions() as s:
            rows = (await s.execute(text(sql), {"t": event_type, "s": str(subject)})).all()
        return [json.loads(r[0]) for r in rows]


@pytest.fixture(scope="module")
async def rt(infra, signer) -> AsyncIterator[Runtime]:
    app = await service_app(
        SPEC,
        infra.admin_url,
        infra.kafka_bootstrap,
        reconcile_interval_s=0.5,
        sse_poll_interval_s=0.1,
        lease_default_s=10,
    )
    async with serving(app, signer) as runtime:
        yield runtime


@asynccontextmanager
async def serving(app: Any, signer: Any) -> AsyncIterator[Runtime]:
    """The app started (its lifespan through `running`) and served over HTTP on a free loopback port."""
    async with running(app, jwks=signer.jwks) as (_, kit):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = _Server(
            uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, timeout_graceful_shutdown=1)
        )
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            yield Runtime(kit, f"http://127.0.0.1:{sock.getsockname()[1]}", signer)
        finally:
            server.should_exit = True
            await asyncio.wait([task], timeout=5)
            if not task.done():
                server.force_exit = True
                await asyncio.wait([task], timeout=5)
            sock.close()


DIGEST1 = "sha256:" + "1" * 64
DIGEST2 = "sha256:" + "2" * 64
INPUTS = {
    "type": "object",
    "properties": {"partition": {"type": "string", "minLength": 1}, "nodes": {"type": "integer", "minimum": 1}},
    "required": ["partition"],
    "additionalProperties": False,
}


@dataclass
class World:
    rt: Runtime
    tenant: uuid.UUID
    project: uuid.UUID
    other_project: uuid.UUID
    admin: uuid.UUID  # project admin
    viewer: uuid.UUID
    outsider: uuid.UUID  # tenant admin elsewhere
    sa: uuid.UUID  # controller service account
    sa_other: uuid.UUID  # same project, app-controller, not bound
    slug: str
    manifests: dict[str, uuid.UUID] = field(default_factory=dict)
    versions: dict[uuid.UUID, int] = field(default_factory=dict)

    def user(self, who: uuid.UUID) -> Client:
        return self.rt.client(self.rt.signer.token(who))

    def controller(self, sa: uuid.UUID | None = None) -> Client:
        sa = sa or self.sa
        return self.rt.client(
            self.rt.signer.token(sa, kind="service_account", project_id=str(self.project), scope="app-controller")
        )

    async def allocation(
        self,
        *,
        shape: CapacityShape = CapacityShape.baremetal,
        gpus: int = 8,
        status: AllocationStatus = AllocationStatus.active,
        project: uuid.UUID | None = None,
        allocation_id: uuid.UUID | None = None,
    ) -> uuid.UUID:
        aid = allocation_id or uuid.uuid4()
        await self.rt.apply(
            self.allocation_event(shape=shape, gpus=gpus, status=status, project=project, allocation_id=aid)
        )
        return aid

    def allocation_event(
        self,
        *,
        shape: CapacityShape = CapacityShape.baremetal,
        gpus: int = 8,
        status: AllocationStatus = AllocationStatus.active,
        project: uuid.UUID | None = None,
        allocation_id: uuid.UUID,
        preemption: al.PreemptionNotice | None = None,
    ) -> Event:
        """The allocation's next event as allocations publishes it (its status's, or with `preemption` the
        notice's), at the allocation's next version."""
        aid = allocation_id
        version = self.versions.get(aid, 0) + 1
        self.versions[aid] = version
        now = datetime.now(UTC)
        state = al.AllocationState(
            allocation_id=aid,
            tenant_id=self.tenant,
            project_id=project or self.project,
            shape=shape,
            gpu_model="H100-80GB",
            gpu_count=gpus,
            status=status,
            status_changed_at=now,
            requested_at=now,
            version=version,
            host_id=uuid.uuid4(),
            preemption=preemption,
        )
        cls = (
            al.AllocationPreemptionScheduled
            if preemption
            else {
                AllocationStatus.active: al.AllocationActivated,
                AllocationStatus.releasing: al.AllocationReleaseRequested,
                AllocationStatus.provisioning: al.AllocationProvisioning,
            }[status]
        )
        return cls.build(data=state, source="allocations")

    async def manifest(
        self,
        version: str,
        *,
        digest: str = DIGEST1,
        active: bool = True,
        deprecated: bool = False,
        multi: bool = True,
        shapes: list[str] | None = None,
        min_gpus: int = 1,
        slug: str | None = None,
        roles: list[cat.AppRole] | None = None,
    ) -> uuid.UUID:
        mid = self.manifests.get(version) or uuid.uuid4()
        self.manifests[version] = mid
        revision = self.versions.get(mid, 0) + 1
        self.versions[mid] = revision
        state = cat.AppManifestState(
            manifest_id=mid,
            slug=slug or self.slug,
            display_name="Test Slurm",
            version=version,
            runtime_version="Slurm 22.05",
            artifact_kind=cat.AppArtifactKind.controller,
            artifact_ref=f"registry.local/apps/slurm@{digest}",
            compatibility=cat.Compatibility(
                requires_capacity_shape=shapes or ["baremetal", "gpu_slice"],
                min_gpu_count=min_gpus,
                multi_allocation=multi,
            ),
            inputs=INPUTS,
            roles=roles or [cat.AppRole(key="slurmctld"), cat.AppRole(key="slurmd")],
            active=active,
            deprecated=deprecated,
            revision=revision,
        )
        cls = cat.AppDeprecated if deprecated else cat.AppRegistered if revision == 1 else cat.AppUpdated
        await self.rt.apply(cls.build(data=state, source="catalog"))
        return mid


async def make_world(rt: Runtime, *, entitled: bool = True) -> World:
    t, t2 = uuid.uuid4(), uuid.uuid4()
    p, p_other, p2 = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    admin, viewer, outsider, sa, sa_other = (uuid.uuid4() for _ in range(5))
    slug = f"slurm-{uuid.uuid4().hex[:6]}"

    def membership(user: uuid.UUID, role: Role, tenant: uuid.UUID, project: uuid.UUID | None) -> Event:
        m = idn.MembershipState(
            membership_id=uuid.uuid4(),
            user_id=user,
            scope=MembershipScope.project if project else MembershipScope.tenant,
            role=role,
            tenant_id=tenant,
            project_id=project,
        )
        return idn.MembershipGranted.build(data=m, source="identity", subject=m.membership_id)

    events: list[Event] = [
        idn.TenantCreated.build(subject=t, source="identity", data=idn.TenantState(tenant_id=t, slug="t", name="T")),
        idn.TenantCreated.build(
            subject=t2, source="identity", data=idn.TenantState(tenant_id=t2, slug="t2", name="T2")
        ),
        *(
            idn.ProjectCreated.build(
                subject=pid, source="identity", data=idn.ProjectState(project_id=pid, tenant_id=tid, name=str(pid))
            )
            for pid, tid in ((p, t), (p_other, t), (p2, t2))
        ),
        membership(admin, Role.project_admin, t, p),
        membership(viewer, Role.viewer, t, p),
        membership(outsider, Role.tenant_admin, t2, None),
        *(
            idn.ServiceAccountCreated.build(
                subject=s,
                source="identity",
                data=idn.ServiceAccountState(
                    service_account_id=s, tenant_id=t, project_id=p, name="ctl", scopes=["app-controller"]
                ),
            )
            for s in (sa, sa_other)
        ),
    ]
    from gpuaas.kit.iam import apply_locally

    async with rt.kit.sessions() as s, s.begin():
        for e in events:
            await apply_locally(s, e)
    w = World(rt, t, p, p_other, admin, viewer, outsider, sa, sa_other, slug)
    if entitled:
        e = cat.EntitlementState(
            entitlement_id=uuid.uuid4(), tenant_id=t, app_slug=slug, granted_at=datetime.now(UTC), version=1
        )
        await rt.apply(cat.EntitlementGranted.build(data=e, source="catalog"))
    await w.manifest("1.0")
    return w


@pytest.fixture
async def world(rt: Runtime) -> World:
    return await make_world(rt)
