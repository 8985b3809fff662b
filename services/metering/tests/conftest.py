"""Metering test support: the real app on a fresh schema, events put on the real broker, IAM seeding."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from gpuaas.contracts import Event, topic_of
from gpuaas.contracts.enums import AllocationStatus, CapacityShape, InstanceStatus, MembershipScope, Role
from gpuaas.contracts.events import allocations as al
from gpuaas.contracts.events import app_runtime as ar
from gpuaas.contracts.events import identity as ev
from gpuaas.kit.iam import apply_locally
from gpuaas.kit.testing import running, service_app
from gpuaas.metering.app import SPEC


async def publish(bootstrap: str, events: Sequence[Event]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for e in events:
            await producer.send_and_wait(topic_of(e).name, e.model_dump_json().encode(), key=e.key())
    finally:
        await producer.stop()


def allocation(event_cls: type[Event], state: al.AllocationState, **changes: Any) -> tuple[Event, al.AllocationState]:
    """The next event of an allocation: its full state with `changes` and the version bumped."""
    new = state.model_copy(update={**changes, "version": state.version + 1})
    return event_cls.build(data=new, source="allocations"), new


def new_allocation(
    tenant: uuid.UUID, project: uuid.UUID, activated_at: datetime, gpus: int = 2, host: uuid.UUID | None = None
) -> tuple[Event, al.AllocationState]:
    s = al.AllocationState(
        allocation_id=uuid.uuid4(),
        tenant_id=tenant,
        project_id=project,
        shape=CapacityShape.gpu_slice,
        gpu_model="H100-80GB",
        gpu_count=gpus,
        host_id=host or uuid.uuid4(),
        status=AllocationStatus.active,
        status_changed_at=activated_at,
        requested_at=activated_at - timedelta(minutes=1),
        activated_at=activated_at,
        version=3,
    )
    return al.AllocationActivated.build(data=s, source="allocations"), s


def instance_created(tenant: uuid.UUID, project: uuid.UUID, at: datetime, slug: str = "vllm") -> Event:
    s = ar.InstanceState(
        instance_id=uuid.uuid4(),
        tenant_id=tenant,
        project_id=project,
        app_slug=slug,
        app_version="0.6.0",
        manifest_id=uuid.uuid4(),
        artifact_digest="sha256:" + "a" * 64,
        status=InstanceStatus.created,
        status_changed_at=at,
        version=1,
    )
    return ar.InstanceCreated.build(data=s, source="app-runtime")


def world_events(w: dict[str, uuid.UUID]) -> list[Event]:
    def member(
        user: uuid.UUID,
        role: Role,
        tenant: uuid.UUID | None,
        project: uuid.UUID | None = None,
        scope: MembershipScope | None = None,
    ) -> Event:
        scope = scope or (MembershipScope.project if project else MembershipScope.tenant)
        m = ev.MembershipState(
            membership_id=uuid.uuid4(), user_id=user, scope=scope, role=role, tenant_id=tenant, project_id=project
        )
        return ev.MembershipGranted.build(subject=m.membership_id, data=m, source="identity")

    return [
        member(w["op"], Role.platform_admin, None, scope=MembershipScope.platform),
        ev.TenantCreated.build(
            subject=w["t1"], source="identity", data=ev.TenantState(tenant_id=w["t1"], slug="t1", name="T1")
        ),
        ev.TenantCreated.build(
            subject=w["t2"], source="identity", data=ev.TenantState(tenant_id=w["t2"], slug="t2", name="T2")
        ),
        ev.ProjectCreated.build(
            subject=w["p1"], source="identity", data=ev.ProjectState(project_id=w["p1"], tenant_id=w["t1"], name="p1")
        ),
        ev.ProjectCreated.build(
            subject=w["p2"], source="identity", data=ev.ProjectState(project_id=w["p2"], tenant_id=w["t2"], name="p2")
        ),
        member(w["viewer"], Role.viewer, w["t1"], w["p1"]),
        member(w["other"], Role.tenant_admin, w["t2"]),
        ev.ServiceAccountCreated.build(
            subject=w["sa"],
            source="identity",
            data=ev.ServiceAccountState(
                service_account_id=w["sa"], tenant_id=w["t1"], project_id=w["p1"], name="ctl", scopes=["app-controller"]
            ),
        ),
        ev.ServiceAccountCreated.build(
            subject=w["sa2"],
            source="identity",
            data=ev.ServiceAccountState(
                service_account_id=w["sa2"],
                tenant_id=w["t2"],
                project_id=w["p2"],
                name="ctl2",
                scopes=["app-controller"],
            ),
        ),
    ]


@pytest.fixture
async def metering(infra, signer) -> AsyncIterator[tuple[Any, Any, dict[str, uuid.UUID]]]:  # type: ignore[no-untyped-def]
    app = await service_app(
        SPEC,
        infra.admin_url,
        infra.kafka_bootstrap,
        window_settle_s=0.0,
        closer_interval_s=0.2,
        heartbeat_grace_s=600.0,
    )
    w = {k: uuid.uuid4() for k in ("t1", "t2", "p1", "p2", "op", "viewer", "other", "sa", "sa2")}
    async with running(app, jwks=signer.jwks) as (client, kit):
        async with kit.sessions() as s, s.begin():
            for e in world_events(w):
                await apply_locally(s, e)
        yield client, kit, w


def now() -> datetime:
    return datetime.now(UTC)


@pytest.fixture
def auth(signer):  # type: ignore[no-untyped-def]
    def make(subject: uuid.UUID, kind: str = "user", **claims: Any) -> dict[str, str]:
        return {"Authorization": f"Bearer {signer.token(subject, kind=kind, **claims)}"}

    return make


@pytest.fixture
def h() -> SimpleNamespace:
    """The helpers above, as a fixture (test folders are not packages, so tests cannot import them)."""
    return SimpleNamespace(
        publish=publish, allocation=allocation, new_allocation=new_allocation, instance_created=instance_created
    )
