"""Billing test support: the real app on a fresh schema, IAM seeded through its own handlers, usage events
applied in-process or put on the real broker."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest

from gpuaas.billing.app import SPEC
from gpuaas.contracts import Event
from gpuaas.contracts.enums import AppUsageUnit, CapacityShape, Role
from gpuaas.contracts.events import usage as usage_events
from gpuaas.kit.testing import running, service_app
from gpuaas.kit.testing_events import (
    apply_events,
    membership_granted,
    platform_admin,
    project_created,
    publish,
    tenant_created,
)


def gpu_usage(
    tenant: uuid.UUID,
    project: uuid.UUID,
    start: datetime,
    end: datetime,
    gpus: int = 2,
    allocation: uuid.UUID | None = None,
    model: str = "H100-80GB",
) -> usage_events.UsageRecorded:
    allocation = allocation or uuid.uuid4()
    seconds = Decimal(gpus) * Decimal(str((end - start).total_seconds()))
    data = usage_events.UsageRecord(
        usage_record_id=usage_events.usage_record_id(allocation, start),
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
    return usage_events.UsageRecorded.build(data=data, source="metering")


def app_usage(
    tenant: uuid.UUID,
    project: uuid.UUID,
    at: datetime,
    quantity: str,
    key: str,
    instance: uuid.UUID | None = None,
    slug: str = "vllm",
) -> usage_events.AppUsageRecorded:
    instance = instance or uuid.uuid4()
    data = usage_events.AppUsageRecord(
        app_usage_record_id=usage_events.app_usage_record_id(instance, key),
        instance_id=instance,
        tenant_id=tenant,
        project_id=project,
        app_slug=slug,
        unit=AppUsageUnit.tokens,
        quantity=Decimal(quantity),
        idempotency_key=key,
        occurred_at=at,
    )
    return usage_events.AppUsageRecorded.build(data=data, source="metering")


def world_events(w: dict[str, uuid.UUID]) -> list[Event]:
    """Two tenants (t1 with projects p1 and p1b, t2 with p2), an operator and t1's roles, t2's admin."""
    return [
        platform_admin(w["op"]),
        tenant_created(w["t1"], "t1"),
        tenant_created(w["t2"], "t2"),
        project_created(w["p1"], w["t1"], "p1"),
        project_created(w["p1b"], w["t1"], "p1b"),
        project_created(w["p2"], w["t2"], "p2"),
        membership_granted(w["tadmin"], Role.tenant_admin, w["t1"]),
        membership_granted(w["padmin"], Role.project_admin, w["t1"], w["p1"]),
        membership_granted(w["viewer"], Role.viewer, w["t1"], w["p1"]),
        membership_granted(w["other"], Role.tenant_admin, w["t2"]),
    ]


@pytest.fixture
async def billing(infra, signer) -> AsyncIterator[tuple[Any, Any, dict[str, uuid.UUID]]]:
    app = await service_app(SPEC, infra.admin_url, infra.kafka_bootstrap)
    w = {k: uuid.uuid4() for k in ("t1", "t2", "p1", "p1b", "p2", "op", "tadmin", "padmin", "viewer", "other")}
    async with running(app, jwks=signer.jwks) as (client, kit):
        await apply_events(kit, *world_events(w))
        yield client, kit, w


@pytest.fixture
def auth(signer):
    def make(subject: uuid.UUID, kind: str = "user", **claims: Any) -> dict[str, str]:
        return {"Authorization": f"Bearer {signer.token(subject, kind=kind, **claims)}"}

    return make


@pytest.fixture
def h() -> SimpleNamespace:
    """The helpers above, as a fixture (test folders are not packages, so tests cannot import them)."""
    return SimpleNamespace(publish=publish, apply=apply_events, gpu_usage=gpu_usage, app_usage=app_usage)
