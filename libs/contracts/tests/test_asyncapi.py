"""The generated AsyncAPI 3.0 document: complete and well-formed."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from gpuaas.contracts.asyncapi import build_document
from gpuaas.contracts.registry import EVENT_TYPES, TOPICS

KEY = re.compile(r"^[\w\d.\-_]+$")  # component / channel / operation ids (AsyncAPI 3.0 schema)


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return build_document()


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for token in ref[2:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        assert token in node, f"unresolved $ref {ref}"
        node = node[token]
    return node


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def test_top_level_shape(doc: dict[str, Any]) -> None:
    assert doc["asyncapi"] == "3.0.0"
    assert doc["info"]["title"] and doc["info"]["version"]
    assert doc["defaultContentType"] == "application/json"
    assert set(doc) >= {"channels", "operations", "components"}
    assert set(doc["components"]) == {"schemas", "messages"}
    json.dumps(doc)  # plain JSON data


def test_every_ref_resolves(doc: dict[str, Any]) -> None:
    for ref in refs(doc):
        resolve(doc, ref)


def test_ids_match_the_asyncapi_key_pattern(doc: dict[str, Any]) -> None:
    for section in (doc["channels"], doc["operations"], doc["components"]["messages"], doc["components"]["schemas"]):
        for key in section:
            assert KEY.match(key), key


def test_one_channel_per_topic(doc: dict[str, Any]) -> None:
    assert set(doc["channels"]) == set(TOPICS)
    for name, topic in TOPICS.items():
        channel = doc["channels"][name]
        assert channel["address"] == name
        assert set(channel["messages"]) == set(topic.by_type)
        kafka = channel["bindings"]["kafka"]
        assert kafka["partitions"] == topic.partitions
        assert kafka["topicConfiguration"]["cleanup.policy"] == ["compact" if topic.compacted else "delete"]


@pytest.mark.parametrize("event_type", sorted(EVENT_TYPES))
def test_every_event_type_is_a_message(doc: dict[str, Any], event_type: str) -> None:
    cls = EVENT_TYPES[event_type]
    message = doc["components"]["messages"][event_type]
    payload = resolve(doc, message["payload"]["$ref"])
    assert payload["properties"]["type"]["const"] == event_type
    assert resolve(doc, doc["channels"][cls.topic]["messages"][event_type]["$ref"]) is message
    key = message["bindings"]["kafka"]["key"]
    assert key["type"] == "string"
    assert f"data.{cls.aggregate_field()}" in key["description"]


def test_owner_sends_and_consumers_receive(doc: dict[str, Any]) -> None:
    operations = doc["operations"].values()
    for name, topic in TOPICS.items():
        ours = [op for op in operations if op["channel"]["$ref"] == f"#/channels/{name}"]
        senders = [op["x-gpuaas-service"] for op in ours if op["action"] == "send"]
        receivers = sorted(op["x-gpuaas-service"] for op in ours if op["action"] == "receive")
        assert senders == [topic.owner]
        assert receivers == sorted(topic.consumers)


def test_operation_messages_belong_to_their_channel(doc: dict[str, Any]) -> None:
    for op_id, op in doc["operations"].items():
        assert op["action"] in {"send", "receive"}, op_id
        channel_ref = op["channel"]["$ref"]
        resolve(doc, channel_ref)
        assert op["messages"], op_id
        for message in op["messages"]:
            assert message["$ref"].startswith(f"{channel_ref}/messages/"), op_id


def test_payload_schemas_use_document_local_refs(doc: dict[str, Any]) -> None:
    assert all(ref.startswith(("#/components/", "#/channels/")) for ref in refs(doc))
