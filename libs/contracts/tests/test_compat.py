"""The compatibility checker itself, on synthetic before/after schemas."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gpuaas.contracts.compat import breaking, compare_files, compare_schema, compare_topic, format_changes


def event(**data_props: Any) -> dict[str, Any]:
    """A small event schema in the shape pydantic writes: envelope + `$defs` payload."""
    return {
        "type": "object",
        "properties": {
            "type": {"const": "thing.happened", "type": "string"},
            "subject": {"type": "string"},
            "data": {"$ref": "#/$defs/ThingState"},
        },
        "required": ["subject", "data"],
        "$defs": {
            "Status": {"enum": ["new", "done"], "type": "string"},
            "ThingState": {
                "type": "object",
                "properties": {
                    "thing_id": {"format": "uuid", "type": "string"},
                    "status": {"$ref": "#/$defs/Status"},
                    "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
                    "count": {"minimum": 0, "type": "integer"},
                    "tags": {"items": {"type": "string"}, "type": "array"},
                    "labels": {"additionalProperties": {"type": "string"}, "type": "object"},
                    **data_props,
                },
                "required": ["thing_id", "status", "count"],
            },
        },
    }


def state(schema: dict[str, Any]) -> dict[str, Any]:
    return schema["$defs"]["ThingState"]


def messages(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [c.message for c in breaking(compare_schema(old, new, where="f.json"))]


# --- accepted ---------------------------------------------------------------------------------


def test_identical_schemas_have_no_changes() -> None:
    assert compare_schema(event(), event()) == []


def test_new_optional_field_is_compatible() -> None:
    new = event(extra={"anyOf": [{"type": "string"}, {"type": "null"}], "default": None})

    changes = compare_schema(event(), new)

    assert breaking(changes) == []
    assert [c.message for c in changes] == ["optional field added"]


def test_new_enum_value_is_a_warning_not_a_break() -> None:
    new = event()
    new["$defs"]["Status"]["enum"].append("archived")

    changes = compare_schema(event(), new)

    assert breaking(changes) == []
    assert "enum value 'archived' added" in changes[0].message


def test_docs_defaults_and_def_names_are_ignored() -> None:
    new = event()
    state(new)["properties"]["count"]["default"] = 3
    state(new)["description"] = "A thing."
    state(new)["title"] = "Renamed"
    new["$defs"]["Renamed"] = new["$defs"].pop("ThingState")
    new["properties"]["data"] = {"$ref": "#/$defs/Renamed", "description": "now documented"}

    assert compare_schema(event(), new) == []


def test_required_field_becoming_optional_is_compatible() -> None:
    new = event()
    state(new)["required"].remove("count")

    assert messages(event(), new) == []


def test_property_order_does_not_matter() -> None:
    new = event()
    state(new)["properties"] = dict(reversed(list(state(new)["properties"].items())))

    assert compare_schema(event(), new) == []


def test_recursive_schemas_terminate() -> None:
    node = {
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
            }
        },
        "$ref": "#/$defs/Node",
    }

    assert compare_schema(node, copy.deepcopy(node)) == []


# --- rejected ---------------------------------------------------------------------------------


def test_removed_field_is_breaking() -> None:
    new = event()
    del state(new)["properties"]["note"]

    assert messages(event(), new) == ["field removed"]


def test_new_required_field_is_breaking() -> None:
    new = event(priority={"type": "integer"})
    state(new)["required"].append("priority")

    assert messages(event(), new) == ["new required field"]


def test_optional_field_becoming_required_is_breaking() -> None:
    new = event()
    state(new)["required"].append("tags")

    assert messages(event(), new) == ["optional field became required"]


@pytest.mark.parametrize(
    ("field", "new_schema", "expected"),
    [
        ("count", {"type": "string"}, "type changed from integer to string"),
        ("thing_id", {"type": "integer"}, "type changed from string to integer"),
        ("count", {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]}, "may now be null"),
        ("note", {"type": "string"}, "may no longer be null"),
        ("thing_id", {"format": "date-time", "type": "string"}, "constraint 'format' changed"),
        ("count", {"minimum": 1, "type": "integer"}, "constraint 'minimum' changed"),
        ("tags", {"items": {"type": "integer"}, "type": "array"}, "type changed from string to integer"),
        ("labels", {"additionalProperties": {"type": "integer"}, "type": "object"}, "type changed"),
        ("thing_id", {}, "type changed from string to any"),
    ],
)
def test_type_changes_are_breaking(field: str, new_schema: dict[str, Any], expected: str) -> None:
    new = event()
    state(new)["properties"][field] = new_schema

    found = messages(event(), new)

    assert len(found) == 1 and found[0].startswith(expected), found


def test_removed_enum_value_is_breaking() -> None:
    new = event()
    new["$defs"]["Status"]["enum"] = ["new"]

    assert messages(event(), new) == ["enum value 'done' removed"]


def test_enum_turned_into_free_string_is_breaking() -> None:
    new = event()
    new["$defs"]["Status"] = {"type": "string"}

    assert messages(event(), new) == ["no longer restricted to ['done', 'new']"]


def test_changed_type_literal_is_breaking() -> None:
    new = event()
    new["properties"]["type"]["const"] = "thing.renamed"

    assert messages(event(), new) == ["enum value 'thing.happened' removed"]


def test_change_location_is_reported() -> None:
    new = event()
    del state(new)["properties"]["note"]

    (change,) = compare_schema(event(), new, where="events/t/thing.happened.json")

    assert change.where == "events/t/thing.happened.json: data.note"
    assert "BREAKING" in format_changes([change])


def test_nested_model_change_is_found_through_refs_and_optionals() -> None:
    def with_child(child_props: dict[str, Any]) -> dict[str, Any]:
        schema = event(child={"anyOf": [{"$ref": "#/$defs/Child"}, {"type": "null"}], "default": None})
        schema["$defs"]["Child"] = {"type": "object", "properties": child_props, "required": list(child_props)}
        return schema

    old = with_child({"a": {"type": "string"}, "b": {"type": "integer"}})
    new = with_child({"a": {"type": "string"}})

    (change,) = breaking(compare_schema(old, new))

    assert change.message == "field removed"
    assert change.where.endswith("data.child.b")


# --- topics and file sets ---------------------------------------------------------------------


def topic(*event_types: str) -> dict[str, Any]:
    return {"x-gpuaas": {"event_types": sorted(event_types)}}


def test_new_event_type_in_topic_is_compatible() -> None:
    assert breaking(compare_topic(topic("a.b"), topic("a.b", "a.c"))) == []


def test_event_type_removed_from_topic_is_breaking() -> None:
    (change,) = breaking(compare_topic(topic("a.b", "a.c"), topic("a.b")))
    assert "'a.c' removed" in change.message


def test_topic_union_without_metadata_uses_the_discriminator_mapping() -> None:
    old = {"discriminator": {"propertyName": "type", "mapping": {"a.b": "#/$defs/A", "a.c": "#/$defs/C"}}}
    new = {"discriminator": {"propertyName": "type", "mapping": {"a.b": "#/$defs/A"}}}
    assert len(breaking(compare_topic(old, new))) == 1


def files(**extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    base = {
        "topics/t.v1.json": topic("thing.happened"),
        "events/t.v1/thing.happened.json": event(),
        "asyncapi.json": {"asyncapi": "3.0.0"},
    }
    return {**base, **extra}


def test_file_sets_accept_new_topics_and_event_types() -> None:
    new = files(**{"topics/u.v1.json": topic("u.x"), "events/u.v1/u.x.json": event()})
    new["topics/t.v1.json"] = topic("thing.happened", "thing.vanished")
    new["events/t.v1/thing.vanished.json"] = event()

    changes = compare_files(files(), new)

    assert breaking(changes) == []
    assert len(changes) == 4


def test_removed_topic_is_breaking() -> None:
    new = files()
    del new["topics/t.v1.json"]
    del new["events/t.v1/thing.happened.json"]

    found = {(c.where, c.message) for c in breaking(compare_files(files(), new))}

    assert ("topics/t.v1.json", "topic removed") in found
    assert ("events/t.v1/thing.happened.json", "event type removed from its topic") in found


def test_derived_documents_are_not_compared() -> None:
    new = files()
    new["asyncapi.json"] = {"asyncapi": "9.9.9"}
    del new["asyncapi.json"]

    assert compare_files(files(), new) == []


def test_breaking_change_inside_an_event_file_is_reported_with_its_path() -> None:
    new = files()
    del state(new["events/t.v1/thing.happened.json"])["properties"]["count"]

    (change,) = breaking(compare_files(files(), new))

    assert change.where == "events/t.v1/thing.happened.json: data.count"


def lease(*kinds: str, release_props: dict[str, Any] | None = None) -> dict[str, Any]:
    """A message whose `payload` is a union discriminated on `kind` (the agent's task lease)."""
    defs = {
        f"{k.title()}Task": {
            "type": "object",
            "properties": {"kind": {"const": k, "type": "string"}, **((release_props or {}) if k == "release" else {})},
            "required": ["kind"],
        }
        for k in kinds
    }
    payload = {
        "discriminator": {"propertyName": "kind", "mapping": {k: f"#/$defs/{k.title()}Task" for k in kinds}},
        "oneOf": [{"$ref": f"#/$defs/{k.title()}Task"} for k in kinds],
    }
    return {"type": "object", "properties": {"payload": payload}, "required": ["payload"], "$defs": defs}


def test_a_tag_added_to_a_discriminated_union_is_compatible_and_one_removed_is_breaking() -> None:
    before, after = lease("provision", "release"), lease("provision", "release", "notify")

    added = compare_schema(before, after)
    assert [(c.message, c.breaking) for c in added] == [("kind 'notify' added (deploy agents first)", False)]
    assert [c.message for c in breaking(compare_schema(after, before))] == ["kind 'notify' removed"]


def test_the_members_of_a_discriminated_union_are_still_compared() -> None:
    before = lease("provision", "release", release_props={"n": {"type": "integer"}})
    after = lease("provision", "release", release_props={"n": {"type": "string"}})

    found = breaking(compare_schema(before, after))
    assert found and all("payload<release>" in c.where for c in found), found
