"""Billing test support: the real app on a fresh schema, usage events on the real broker, IAM seeding."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from gpuaas.billing.app import SPEC
from gpuaas.contracts import Event, topic_of
from gpuaas.contracts.enums import AppUsageUnit, CapacityShape, MembershipScope, Role
from gpuaas.contracts.events import identity as ev
from gpuaas.contracts.events import usage as us
from gpuaas.kit.iam import apply_locally
from gpuaas.kit.testing import running, service_app


async def publish(bootstrap: str, events: Sequence[Event]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        futures = [await producer.send(topic_of(e).name, e.model_dump_json().encode(), key=e.key()) for e in events]
        for f in futures:
            await f
    finally:
        await producer.stop()


def gpu_usage(
    tenant: uuid.UUID,
    project: uuid.UUID,
    start: datetime,
    end: datetime,
    gpus: int = 2,
    allocation: uuid.UUID | None = None,
    model: str = "H100-80GB",
) -> us.UsageRecorded:
    allocation = allocation or uuid.uuid4()
    seconds = Decimal(gpus) * Decimal(str((end - start).total_seconds()))
    data = us.UsageRecord(
        usage_record_id=us.usage_record_id(allocation, start),
        allocation_id=allocation,
        tenant_id=tenant,
        project_id=project,
        shape=CapacityShape.gpu_slice,
        gpu_model=model,
        gpu_count=gpus,
        window_start=start,
        window_end=end,
        gpu_seconds=seconds,
    )
    return us.UsageRecorded.build(data=data, source="metering")


def app_usage(
    tenant: uuid.UUID,
    project: uuid.UUID,
    at: datetime,
    quantity: str,
    key: str,
    instance: uuid.UUID | None = None,
    slug: str = "vllm",
) -> us.AppUsageRecorded:
    instance = instance or uuid.uuid4()
    data = us.AppUsageRecord(
        app_usage_record_id=us.app_usage_record_id(instance, key),
        instance_id=instance,
        tenant_id=tenant,
        project_id=project,
        app_slug=slug,
        unit=AppUsageUnit.tokens,
        quantity=Decimal(quantity),
        idempotency_key=key,
        occurred_at=at,
    )
    return us.AppUsageRecorded.build(data=data, source="metering")


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
            subject=w["p1b"],
            source="identity",
            data=ev.ProjectState(project_id=w["p1b"], tenant_id=w["t1"], name="p1b"),
        ),
        ev.ProjectCreated.build(
            subject=w["p2"], source="identity", data=ev.ProjectState(project_id=w["p2"], tenant_id=w["t2"], name="p2")
        ),
        member(w["tadmin"], Role.tenant_admin, w["t1"]),
        member(w["padmin"], Role.project_admin, w["t1"], w["p1"]),
        member(w["viewer"], Role.viewer, w["t1"], w["p1"]),
        member(w["other"], Role.tenant_admin, w["t2"]),
    ]


@pytest.fixture
async def billing(infra, signer) -> AsyncIterator[tuple[Any, Any, dict[str, uuid.UUID]]]:  # type: ignore[no-untyped-def]
    app = await service_app(SPEC, infra.admin_url, infra.kafka_bootstrap)
    w = {k: uuid.uuid4() for k in ("t1", "t2", "p1", "p1b", "p2", "op", "tadmin", "padmin", "viewer", "other")}
    async with running(app, jwks=signer.jwks) as (client, kit):
        async with kit.sessions() as s, s.begin():
            for e in world_events(w):
                await apply_locally(s, e)
        yield client, kit, w


@pytest.fixture
def auth(signer):  # type: ignore[no-untyped-def]
    def make(subject: uuid.UUID, kind: str = "user", **claims: Any) -> dict[str, str]:
        return {"Authorization": f"Bearer {signer.token(subject, kind=kind, **claims)}"}

    return make


def now() -> datetime:
    return datetime.now(UTC)


@pytest.fixture
def h() -> SimpleNamespace:
    """The helpers above, as a fixture (test folders are not packages, so tests cannot import them)."""
    return SimpleNamespace(publish=publish, gpu_usage=gpu_usage, app_usage=app_usage)
