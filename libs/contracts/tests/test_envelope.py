"""Envelope helpers: building events, stable ids, UUIDv7."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest

from gpuaas.contracts import Event, new_event_id
from gpuaas.contracts.envelope import stable_id
from gpuaas.contracts.events import allocations, audit, identity
from gpuaas.contracts.testing import sample_payload


def test_build_takes_subject_and_tenancy_from_the_payload() -> None:
    state = sample_payload(allocations.AllocationState)

    event = allocations.AllocationActivated.build(data=state, source="allocations")

    assert event.type == "allocation.activated"
    assert event.subject == str(state.allocation_id)
    assert event.tenant_id == state.tenant_id
    assert event.project_id == state.project_id


def test_build_accepts_a_dict_payload() -> None:
    state = sample_payload(allocations.HostState).model_dump(mode="json")

    event = allocations.HostEnrolled.build(data=state, source="allocations")

    assert event.subject == state["host_id"]
    assert event.tenant_id is None


def test_explicit_attributes_win() -> None:
    state = sample_payload(allocations.AllocationState)
    tenant = uuid.uuid4()

    event = allocations.AllocationActivated.build(subject="custom", data=state, source="x", tenant_id=tenant)

    assert (event.subject, event.tenant_id) == ("custom", tenant)


def test_existing_call_style_still_works() -> None:
    state = identity.TenantState(tenant_id=uuid.uuid4(), slug="acme", name="Acme")

    event = identity.TenantCreated.build(subject=state.tenant_id, data=state, source="identity")

    assert event.subject == str(state.tenant_id)


def test_build_without_any_subject_fails() -> None:
    class Untyped(Event):
        type: str = "untyped.thing"

    with pytest.raises(ValueError, match="subject"):
        Untyped.build(data={"x": 1}, source="tests")


def test_audit_records_are_keyed_by_resource() -> None:
    record = audit.AuditRecord(service="billing", action="billing.read", resource_type="x", resource_id="r-1")
    assert audit.AuditRecorded.build(data=record, source="billing").subject == "r-1"


def test_stable_id_is_deterministic() -> None:
    moment = datetime(2026, 5, 1, 12, tzinfo=UTC)
    plus_two = moment.astimezone(timezone(timedelta(hours=2)))

    assert stable_id("k", "a", moment) == stable_id("k", "a", plus_two)
    assert stable_id("k", "a") != stable_id("k2", "a")
    assert stable_id("k", "a", "b") != stable_id("k", "ab")
    assert stable_id("k").version == 5


def test_stable_id_rejects_naive_datetimes() -> None:
    with pytest.raises(ValueError, match="timezone"):
        stable_id("k", datetime(2026, 1, 1))


def test_new_event_id_is_a_time_ordered_uuid7() -> None:
    ids = [new_event_id() for _ in range(50)]
    assert all(i.version == 7 for i in ids)
    assert [i.int >> 80 for i in ids] == sorted(i.int >> 80 for i in ids)
