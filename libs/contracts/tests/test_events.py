"""Every registered event type: round trip, tolerance of unknowns, rejection of malformed input."""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from pydantic import ValidationError

from gpuaas.contracts import TOPICS, Event, parse_event, topic_of
from gpuaas.contracts.events import allocations, billing, catalog, usage
from gpuaas.contracts.registry import EVENT_TYPES
from gpuaas.contracts.testing import SAMPLE_DIGEST, sample_event, sample_payload

ALL_EVENTS = sorted(EVENT_TYPES.items())
EVENT_IDS = [t for t, _ in ALL_EVENTS]


@pytest.mark.parametrize(("event_type", "cls"), ALL_EVENTS, ids=EVENT_IDS)
def test_round_trip_through_json(event_type: str, cls: type[Event]) -> None:
    event = sample_event(cls)
    raw = event.model_dump_json().encode()

    parsed = topic_of(cls).parse(raw)

    assert type(parsed) is cls
    assert parsed == event
    assert parse_event(cls.topic, raw.decode()) == event
    assert parse_event(cls.topic, event.model_dump(mode="json")) == event


@pytest.mark.parametrize(("event_type", "cls"), ALL_EVENTS, ids=EVENT_IDS)
def test_subject_is_the_aggregate_id(event_type: str, cls: type[Event]) -> None:
    field = cls.aggregate_field()
    assert field is not None, f"{cls.__name__}: its payload must name its aggregate_field"
    assert field in cls.payload_model().model_fields

    event = sample_event(cls)

    assert event.subject == str(getattr(event.data, field))
    assert event.key() == event.subject.encode()
    assert event.type == event_type


@pytest.mark.parametrize(("event_type", "cls"), ALL_EVENTS, ids=EVENT_IDS)
def test_unknown_fields_are_ignored(event_type: str, cls: type[Event]) -> None:
    event = sample_event(cls)
    doc = event.model_dump(mode="json")
    doc["added_by_a_newer_producer"] = 1
    doc["data"]["also_new"] = {"nested": True}

    assert topic_of(cls).parse(json.dumps(doc)) == event


@pytest.mark.parametrize(("event_type", "cls"), ALL_EVENTS, ids=EVENT_IDS)
def test_missing_required_payload_field_is_rejected(event_type: str, cls: type[Event]) -> None:
    doc = sample_event(cls).model_dump(mode="json")
    required = [n for n, f in cls.payload_model().model_fields.items() if f.is_required()]
    del doc["data"][required[0]]

    with pytest.raises(ValidationError):
        topic_of(cls).parse(doc)


def test_unknown_event_type_is_skipped() -> None:
    doc = sample_event(allocations.AllocationActivated).model_dump(mode="json")
    doc["type"] = "allocation.teleported"

    assert parse_event(allocations.AllocationActivated.topic, doc) is None


def test_event_type_of_another_topic_is_unknown_here() -> None:
    doc = sample_event(usage.UsageRecorded).model_dump(mode="json")

    assert TOPICS["gpuaas.allocations.v1"].parse(doc) is None


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"[1, 2]", b'"a string"'],
    ids=["not-json", "array", "string"],
)
def test_non_object_messages_raise_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        TOPICS["gpuaas.usage.v1"].parse(raw)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("data", "gpu_count"), "many"),
        (("data", "allocation_id"), "not-a-uuid"),
        (("data", "status"), "teleporting"),
        (("data", "requested_at"), "yesterday"),
        (("subject",), None),
        (("data",), None),
    ],
)
def test_malformed_events_raise_validation_error(path: tuple[str, ...], value: object) -> None:
    doc = sample_event(allocations.AllocationActivated).model_dump(mode="json")
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value

    with pytest.raises(ValidationError):
        TOPICS["gpuaas.allocations.v1"].parse(doc)


def test_discriminated_union_resolves_by_type_for_shared_payloads() -> None:
    topic = TOPICS["gpuaas.allocations.v1"]
    doc = sample_event(allocations.AllocationActivated).model_dump(mode="json")
    for event_type in ("allocation.requested", "allocation.released", "allocation.release_failed"):
        doc["type"] = event_type
        parsed = topic.union.validate_python(doc)
        assert type(parsed) is topic.by_type[event_type]
        assert parsed.data == allocations.AllocationState.model_validate(doc["data"])


def test_discriminated_union_rejects_payload_of_another_type() -> None:
    doc = sample_event(allocations.HostEnrolled).model_dump(mode="json")
    doc["type"] = "allocation.activated"  # a host payload under an allocation type

    with pytest.raises(ValidationError):
        TOPICS["gpuaas.allocations.v1"].parse(doc)


# --- registry invariants ----------------------------------------------------------------------


def test_each_event_type_belongs_to_exactly_one_topic() -> None:
    seen: dict[str, str] = {}
    for topic in TOPICS.values():
        for event_type, cls in topic.by_type.items():
            assert event_type not in seen, f"{event_type} on {seen.get(event_type)} and {topic.name}"
            seen[event_type] = topic.name
            assert cls.topic == topic.name
            assert topic_of(cls) is topic
    assert seen.keys() == EVENT_TYPES.keys()


def test_a_topic_cannot_take_an_event_type_of_another_topic() -> None:
    from gpuaas.contracts.registry import Topic

    with pytest.raises(ValueError, match="one topic"):
        Topic("gpuaas.other.v1", "nobody", "", (usage.UsageRecorded,))
    assert usage.UsageRecorded.topic == "gpuaas.usage.v1"


def test_all_topics_are_registered() -> None:
    assert set(TOPICS) == {
        "gpuaas.identity.v1",
        "gpuaas.allocations.v1",
        "gpuaas.catalog.v1",
        "gpuaas.app-runtime.v1",
        "gpuaas.usage.v1",
        "gpuaas.billing.v1",
        "gpuaas.audit.v1",
    }
    for topic in TOPICS.values():
        assert re.fullmatch(r"gpuaas\.[a-z-]+\.v[0-9]+", topic.name)
        assert topic.events, topic.name


@pytest.mark.parametrize(("event_type", "cls"), ALL_EVENTS, ids=EVENT_IDS)
def test_event_type_naming(event_type: str, cls: type[Event]) -> None:
    assert re.fullmatch(r"[a-z_]+\.[a-z_]+", event_type)
    assert cls.model_fields["type"].default == event_type


def test_projection_topics_are_compacted_and_fact_topics_are_not() -> None:
    compacted = {t.name for t in TOPICS.values() if t.compacted}
    assert compacted == {
        "gpuaas.identity.v1",
        "gpuaas.allocations.v1",
        "gpuaas.catalog.v1",
        "gpuaas.app-runtime.v1",
    }


# --- scalar rules -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "amount",
    ["0.000000000000000001", "12345678901234567890.123456789012345678", "-0.10", "1000", "0E-12"],
)
def test_decimal_precision_survives_json(amount: str) -> None:
    charge = sample_payload(billing.ChargeState).model_copy(update={"amount": Decimal(amount)})
    event = billing.ChargePosted.build(data=charge, source="billing")

    raw = event.model_dump_json()
    parsed = parse_event("gpuaas.billing.v1", raw)

    assert parsed.data.amount == Decimal(amount)
    assert str(parsed.data.amount) == str(Decimal(amount))  # exponent and trailing zeros kept
    assert isinstance(json.loads(raw)["data"]["amount"], str)


def test_decimals_are_written_without_exponent() -> None:
    charge = sample_payload(billing.ChargeState).model_copy(update={"amount": Decimal("1E+3")})
    doc = json.loads(billing.ChargePosted.build(data=charge, source="billing").model_dump_json())
    assert doc["data"]["amount"] == "1000"


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-1", "abc"])
def test_quantities_reject_nan_infinity_and_negatives(bad: str) -> None:
    doc = sample_payload(usage.UsageRecord).model_dump(mode="json")
    doc["gpu_seconds"] = bad
    with pytest.raises(ValidationError):
        usage.UsageRecord.model_validate(doc)


def test_naive_datetimes_are_rejected() -> None:
    doc = sample_payload(usage.UsageRecord).model_dump()
    doc["window_start"] = datetime(2026, 1, 1)
    with pytest.raises(ValidationError, match="timezone"):
        usage.UsageRecord.model_validate(doc)


def test_usage_window_must_be_ordered() -> None:
    doc = sample_payload(usage.UsageRecord).model_dump()
    doc["window_start"], doc["window_end"] = doc["window_end"], doc["window_start"]
    with pytest.raises(ValidationError, match="window_end"):
        usage.UsageRecord.model_validate(doc)


@pytest.mark.parametrize("ref", ["registry.example/app:latest", "registry.example/app", "app@sha256:abc"])
def test_artifact_refs_must_be_pinned_by_digest(ref: str) -> None:
    doc = sample_payload(catalog.AppManifestState).model_dump()
    doc["artifact_ref"] = ref
    with pytest.raises(ValidationError):
        catalog.AppManifestState.model_validate(doc)


def test_pinned_ref_accepts_a_digest() -> None:
    doc = sample_payload(catalog.AppManifestState).model_dump()
    doc["artifact_ref"] = f"ghcr.io/org/jupyter@{SAMPLE_DIGEST}"
    assert catalog.AppManifestState.model_validate(doc).artifact_ref.endswith(SAMPLE_DIGEST)


def test_currency_is_an_iso_code() -> None:
    doc = sample_payload(billing.PriceState).model_dump()
    doc["currency"] = "euro"
    with pytest.raises(ValidationError):
        billing.PriceState.model_validate(doc)


# --- deterministic ids ------------------------------------------------------------------------


def test_usage_record_id_is_deterministic_and_zone_independent() -> None:
    allocation = uuid.uuid4()
    start = datetime(2026, 3, 1, 10, tzinfo=UTC)
    from zoneinfo import ZoneInfo

    same_instant = start.astimezone(ZoneInfo("Europe/Paris"))

    assert usage.usage_record_id(allocation, start) == usage.usage_record_id(allocation, same_instant)
    assert usage.usage_record_id(allocation, start) != usage.usage_record_id(uuid.uuid4(), start)
    assert usage.app_usage_record_id(allocation, "k1") == usage.app_usage_record_id(allocation, "k1")
    assert usage.app_usage_record_id(allocation, "k1") != usage.app_usage_record_id(allocation, "k2")
