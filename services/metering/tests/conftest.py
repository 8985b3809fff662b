"""Metering test support: the real app on a fresh schema, IAM seeded through its own handlers, lifecycle
events applied in-process or put on the real broker, and the window closer driven at chosen instants.

The `metering` app's own window closer runs once at start-up and then stays idle: a test moves the
closer itself with `h.close_windows(kit, at=...)`, so where windows fall never depends on the wall clock
(an hour boundary passing mid-test cannot record a window behind the test's back). `metering_live_closer`
runs it every 0.2 s for the test of the background loop itself.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from gpuaas.contracts import Event
from gpuaas.contracts.enums import AllocationStatus, CapacityShape, InstanceStatus, Role
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.contracts.events import app_runtime as app_runtime_events
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.testing import running, service_app
from gpuaas.kit.testing_events import (
    apply_events,
    membership_granted,
    platform_admin,
    project_created,
    publish,
    service_account_created,
    tenant_created,
)
from gpuaas.metering.app import SPEC
from gpuaas.metering.reconciler import close_windows_once

World = tuple[Any, KitRuntime, dict[str, uuid.UUID]]
CLOSER_BATCH = 5  # small, so a test can fill a batch


def allocation(
    event_cls: type[Event], state: allocation_events.AllocationState, **changes: Any
) -> tuple[Event, allocation_events.AllocationState]:
    """The next event of an allocation: its full state with `changes` and the version bumped."""
    new = state.model_copy(update={**changes, "version": state.version + 1})
    return event_cls.build(data=new, source="allocations"), new


def new_allocation(
    tenant: uuid.UUID, project: uuid.UUID, activated_at: datetime, gpus: int = 2, host: uuid.UUID | None = None
) -> tuple[Event, allocation_events.AllocationState]:
    s = allocation_events.AllocationState(
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
    return allocation_events.AllocationActivated.build(data=s, source="allocations"), s


def instance_created(tenant: uuid.UUID, project: uuid.UUID, at: datetime, slug: str = "vllm") -> Event:
    s = app_runtime_events.InstanceState(
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
    return app_runtime_events.InstanceCreated.build(data=s, source="app-runtime")


async def close_windows(kit: KitRuntime, *, at: datetime) -> bool:
    """One batch of the window closer as of `at` (settle 0 here); True when the batch was full."""
    return await close_windows_once(kit, now=at)


def world_events(w: dict[str, uuid.UUID]) -> list[Event]:
    """Two tenants (t1/p1, t2/p2), an operator, a viewer of p1, t2's admin, an app controller in each project."""
    return [
        platform_admin(w["op"]),
        tenant_created(w["t1"], "t1"),
        tenant_created(w["t2"], "t2"),
        project_created(w["p1"], w["t1"], "p1"),
        project_created(w["p2"], w["t2"], "p2"),
        membership_granted(w["viewer"], Role.viewer, w["t1"], w["p1"]),
        membership_granted(w["other"], Role.tenant_admin, w["t2"]),
        service_account_created(w["sa"], w["t1"], w["p1"], "ctl"),
        service_account_created(w["sa2"], w["t2"], w["p2"], "ctl2"),
    ]


@asynccontextmanager
async def metering_app(infra: Any, signer: Any, closer_interval_s: float) -> AsyncIterator[World]:
    app = await service_app(
        SPEC,
        infra.admin_url,
        infra.kafka_bootstrap,
        window_settle_s=0.0,
        closer_interval_s=closer_interval_s,
        closer_batch=CLOSER_BATCH,
        heartbeat_grace_s=600.0,
    )
    w = {k: uuid.uuid4() for k in ("t1", "t2", "p1", "p2", "op", "viewer", "other", "sa", "sa2")}
    async with running(app, jwks=signer.jwks) as (client, kit):
        await apply_events(kit, *world_events(w))
        yield client, kit, w


@pytest.fixture
async def metering(infra, signer) -> AsyncIterator[World]:
    async with metering_app(infra, signer, closer_interval_s=3600.0) as world:
        yield world


@pytest.fixture
async def metering_live_closer(infra, signer) -> AsyncIterator[World]:
    async with metering_app(infra, signer, closer_interval_s=0.2) as world:
        yield world


@pytest.fixture
def auth(signer):
    def make(subject: uuid.UUID, kind: str = "user", **claims: Any) -> dict[str, str]:
        return {"Authorization": f"Bearer {signer.token(subject, kind=kind, **claims)}"}

    return make


@pytest.fixture
def h() -> SimpleNamespace:
    """The helpers above, as a fixture (test folders are not packages, so tests cannot import them)."""
    return SimpleNamespace(
        publish=publish,
        apply=apply_events,
        allocation=allocation,
        new_allocation=new_allocation,
        instance_created=instance_created,
        close_windows=close_windows,
    )
