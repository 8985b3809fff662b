"""gpuaas.contracts.faststream without a database: decoding into the typed union, envelope metadata, the
prefix, and the consumer's AsyncAPI document (the inbox is tested on Postgres in examples/billing-export)."""

from __future__ import annotations

import json

import pytest
from faststream.kafka import KafkaBroker
from pydantic import TypeAdapter

from gpuaas.contracts import Actor
from gpuaas.contracts.events import billing, usage
from gpuaas.contracts.faststream import PgInbox, asyncapi, decode_records, event_subscriber, event_union, meta
from gpuaas.contracts.packaged import asyncapi_document, schema_dir, topic_schema
from gpuaas.contracts.registry import BILLING, TOPICS, USAGE
from gpuaas.contracts.testing import sample_event


def test_records_decode_into_their_typed_classes_and_the_rest_is_skipped() -> None:
    charge = sample_event(billing.ChargePosted)
    record = sample_event(usage.UsageRecorded)
    unknown = charge.model_dump(mode="json") | {"type": "charge.refunded"}
    skipped: list[str] = []
    events = decode_records(
        [
            ("staging." + BILLING, charge.model_dump_json().encode()),
            ("staging." + BILLING, json.dumps(unknown).encode()),
            ("staging." + BILLING, b"{"),
            ("staging." + USAGE, record.model_dump_json().encode()),
            ("staging.other.v1", b"{}"),
        ],
        prefix="staging.",
        skipped=skipped,
    )
    assert [type(e) for e in events] == [billing.ChargePosted, usage.UsageRecorded]
    assert events[0] == charge
    assert [s.split(":")[0] for s in skipped] == [
        "unknown event type on gpuaas.billing.v1",
        "malformed event on gpuaas.billing.v1",
        "not a contracts topic",
    ]


def test_the_union_of_several_topics_validates_each_event_type() -> None:
    adapter = TypeAdapter(event_union(BILLING, USAGE))
    for topic in (BILLING, USAGE):
        for cls in TOPICS[topic].events:
            assert type(adapter.validate_python(sample_event(cls).model_dump(mode="json"))) is cls
    with pytest.raises(ValueError, match="unknown topics"):
        event_union("gpuaas.nope.v1")


def test_meta_is_the_envelope_without_the_payload() -> None:
    e = sample_event(billing.ChargePosted, correlation_id="req-1", actor=Actor.system("billing"))
    m = meta(e)
    assert (m.event_id, m.type, m.topic, m.correlation_id) == (e.id, "charge.posted", BILLING, "req-1")
    assert (m.tenant_id, m.project_id, m.actor, m.subject) == (e.tenant_id, e.project_id, e.actor, e.subject)


def test_the_subscriber_is_a_manual_ack_batch_on_the_prefixed_topics_and_documented() -> None:
    broker = KafkaBroker("localhost:9092")
    inbox = PgInbox(lambda: None, schema="warehouse", consumer="loader")

    @event_subscriber(broker, BILLING, USAGE, group="loader", prefix="prod.", inbox=inbox, max_records=100)
    async def load(conn, events) -> None:
        """Load usage and charges."""

    [sub] = list(broker.subscribers)
    assert sorted(t.name for t in sub.topics) == ["prod." + BILLING, "prod." + USAGE]
    assert sub.group_id == "prod.loader" and sub._connection_args["enable_auto_commit"] is False
    doc = asyncapi(broker, title="loader")
    assert {c["address"] for c in doc["channels"].values()} == {"prod." + BILLING, "prod." + USAGE}
    schemas = json.dumps(doc["components"]["schemas"])
    assert "ChargePosted" in schemas and "UsageRecorded" in schemas
    with pytest.raises(ValueError, match="identifier"):
        PgInbox(lambda: None, schema="Bad-Name", consumer="x")


def test_packaged_documents_are_found_in_a_source_checkout() -> None:
    assert (schema_dir() / "asyncapi.json").is_file()
    assert asyncapi_document()["asyncapi"] == "3.0.0"
    assert "oneOf" in json.dumps(topic_schema(BILLING))
