"""Metering's business metrics on /metrics (issue 16): meters by status and the usage records it emits,
counted once their transaction commits (a window recorded again writes nothing and counts nothing). The app
runs without its consumer, so only this test's events reach it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuaas.contracts.enums import AllocationStatus
from gpuaas.contracts.events import allocations as allocation_events
from gpuaas.kit.testing import running, service_app
from gpuaas.metering.app import SPEC
from gpuaas.metering.domain import hour_floor

pytestmark = pytest.mark.integration


@pytest.fixture
async def quiet_metering(infra) -> AsyncIterator[tuple[Any, Any]]:
    app = await service_app(
        SPEC, infra.admin_url, infra.kafka_bootstrap, run_consumers=False, window_settle_s=0.0, closer_interval_s=3600.0
    )
    async with running(app, wait_consumer=False) as (client, kit):
        yield client, kit


async def scrape(client: Any) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    body = (await client.get("/metrics")).text
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if k != "service")): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.labels.get("service") == "metering"
    }


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def test_meters_and_emitted_usage_records(h, quiet_metering) -> None:
    client, kit = quiet_metering
    before = await scrape(client)
    assert value(before, "gpuaas_meters", status="open") == 0.0
    assert value(before, "gpuaas_usage_records_emitted_total", kind="gpu") is None  # nothing emitted yet
    start = hour_floor(datetime.now(UTC)) - timedelta(hours=3)
    opened, a = h.new_allocation(uuid.uuid4(), uuid.uuid4(), start, gpus=2)
    await h.apply(kit, opened)
    await h.close_windows(kit, at=start + timedelta(hours=2, minutes=1))  # two whole hours recorded
    await h.close_windows(kit, at=start + timedelta(hours=2, minutes=2))  # nothing new: counts nothing
    mid = await scrape(client)
    assert value(mid, "gpuaas_meters", status="open") == 1.0
    assert value(mid, "gpuaas_usage_records_emitted_total", kind="gpu") == 2.0
    stop = start + timedelta(hours=2, minutes=30)
    released, _ = h.allocation(
        allocation_events.AllocationReleaseRequested,
        a,
        status=AllocationStatus.releasing,
        status_changed_at=stop,
        release_requested_at=stop,
        billing_stopped_at=stop,
    )
    await h.apply(kit, released)
    await h.apply(kit, released)  # redelivered: a stale version, no record, nothing counted
    after = await scrape(client)
    assert value(after, "gpuaas_meters", status="closed") == 1.0
    assert value(after, "gpuaas_meters", status="open") == 0.0
    assert value(after, "gpuaas_meters", status="suspended") == 0.0
    assert value(after, "gpuaas_usage_records_emitted_total", kind="gpu") == 3.0  # and the final half hour
