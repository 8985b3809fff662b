"""Backward-compatibility check between two generations of the event schemas (and of the node agent
protocol's, `agent/`, by the same rules: the control plane and the agents deploy independently).

Within a topic version, a change must keep both directions working, because services deploy
independently and compacted topics are replayed:

- an *old* consumer must parse what a *new* producer sends: no field removed, no type widened,
  no constraint relaxed;
- a *new* consumer must parse what an *old* producer sent (replay): no new required field, no
  optional field made required, no type narrowed, no enum value removed, no event type removed.

So, in short, the set of accepted values must not change, except for:
- new optional fields (consumers ignore unknown fields): compatible;
- new event types in a topic, and new topics (consumers skip unknown types): compatible;
- new enum values: reported as a *warning*, not breaking. Old consumers reject a value they do
  not know, so deploy the consumers before the producer that emits the new value.

Descriptions, titles, defaults and the names of `$defs` are ignored: refs are resolved and the
schemas compared structurally, so renaming a nested model is not a change.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

Schema = Mapping[str, Any]

CONSTRAINT_KEYWORDS = (
    "format",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "uniqueItems",
    "minProperties",
    "maxProperties",
)


@dataclass(frozen=True, order=True)
class Change:
    """One difference; `breaking` changes fail the check, the others are informational."""

    where: str
    message: str
    breaking: bool = True

    def __str__(self) -> str:
        return f"{'BREAKING' if self.breaking else 'note'}: {self.where}: {self.message}"


def breaking(changes: Iterable[Change]) -> list[Change]:
    return [c for c in changes if c.breaking]


def format_changes(changes: Iterable[Change]) -> str:
    return "\n".join(str(c) for c in sorted(changes, key=lambda c: (not c.breaking, c.where, c.message)))


# --- file sets ------------------------------------------------------------------------------


def compare_files(old: Mapping[str, Schema], new: Mapping[str, Schema]) -> list[Change]:
    """Compare two schema directories (relative path → document), as written by the export.

    Only `topics/*.json`, `events/*/*.json` and the agent protocol's `agent/**.json` are contracts;
    other files (the AsyncAPI document) are derived from them and not compared.
    """
    changes: list[Change] = []
    for path in sorted(old.keys() | new.keys()):
        kind = _file_kind(path)
        if kind is None:
            continue
        if path not in new:
            changes.append(Change(path, _REMOVED[kind]))
        elif path not in old:
            changes.append(Change(path, f"new {kind}", breaking=False))
        elif kind == "topic":
            changes.extend(compare_topic(old[path], new[path], where=path))
        elif kind == "agent task union":
            changes.extend(compare_kinds(old[path], new[path], where=path))
        else:
            changes.extend(compare_schema(old[path], new[path], where=path))
    return changes


_REMOVED = {
    "topic": "topic removed",
    "event type": "event type removed from its topic",
    "agent message": "agent protocol message removed",
    "agent task union": "agent protocol union removed",
}


def _file_kind(path: str) -> str | None:
    parts = path.split("/")
    if not parts[-1].endswith(".json"):
        return None
    if len(parts) == 2 and parts[0] == "topics":
        return "topic"
    if len(parts) == 3 and parts[0] == "events":
        return "event type"
    if parts[0] == "agent":
        return "agent task union" if len(parts) == 2 and parts[1] in ("tasks.json", "results.json") else "agent message"
    return None


def compare_kinds(old: Schema, new: Schema, *, where: str = "") -> list[Change]:
    """The kinds of an agent protocol union: removing one is breaking (an agent one version behind still sends
    or expects it); adding one is not (an older agent fails a task of a kind it does not know, by its reason)."""
    before, after = set(old.get("x-gpuaas", {}).get("kinds", ())), set(new.get("x-gpuaas", {}).get("kinds", ()))
    changes = [Change(where, f"kind {k!r} removed") for k in sorted(before - after)]
    added = sorted(after - before)
    changes += [Change(where, f"kind {k!r} added (deploy agents first)", breaking=False) for k in added]
    return changes


def topic_event_types(schema: Schema) -> set[str]:
    meta = schema.get("x-gpuaas", {})
    if "event_types" in meta:
        return set(meta["event_types"])
    return set(schema.get("discriminator", {}).get("mapping", {}))


def compare_topic(old: Schema, new: Schema, *, where: str = "") -> list[Change]:
    """Event types of a topic union: removing one is breaking, adding one is not."""
    before, after = topic_event_types(old), topic_event_types(new)
    changes = [Change(where, f"event type {t!r} removed from the topic") for t in sorted(before - after)]
    changes += [Change(where, f"event type {t!r} added", breaking=False) for t in sorted(after - before)]
    return changes


# --- one schema -----------------------------------------------------------------------------


def compare_schema(old: Schema, new: Schema, *, where: str = "") -> list[Change]:
    """Structural comparison of two JSON Schemas (each resolving its own local `$ref`s)."""
    walker = _Walker(old, new, where)
    walker.compare(old, new, "")
    return walker.changes


@dataclass
class _Walker:
    old_root: Schema
    new_root: Schema
    where: str
    changes: list[Change] = field(default_factory=list)
    _visited: set[tuple[str, str, str]] = field(default_factory=set)

    def _add(self, path: str, message: str, *, breaking: bool = True) -> None:
        location = f"{self.where}: {path}" if path else self.where
        self.changes.append(Change(location or "<root>", message, breaking))

    def compare(self, old: Schema, new: Schema, path: str) -> None:
        old_tags, new_tags = _tags(old), _tags(new)
        if old_tags is not None and new_tags is not None:
            self._compare_tagged(old_tags, new_tags, path)
            return
        old_alts = _alternatives(self.old_root, old)
        new_alts = _alternatives(self.new_root, new)
        old_kinds = {_kind(s) for _, s in old_alts}
        new_kinds = {_kind(s) for _, s in new_alts}
        if old_kinds != new_kinds:
            self._add(path, _describe_kind_change(old_kinds, new_kinds))
        for kind in sorted(old_kinds & new_kinds):
            olds = [a for a in old_alts if _kind(a[1]) == kind]
            news = [a for a in new_alts if _kind(a[1]) == kind]
            if len(olds) != len(news):
                self._add(path, f"number of {kind} alternatives changed from {len(olds)} to {len(news)}")
            for (old_ref, o), (new_ref, n) in _pair(olds, news):
                if old_ref and new_ref:
                    key = (old_ref, new_ref, kind)
                    if key in self._visited:
                        continue  # compared already (shared or recursive definition)
                    self._visited.add(key)
                self._compare_same_kind(o, n, kind, path)

    def _compare_tagged(self, old: Mapping[str, str], new: Mapping[str, str], path: str) -> None:
        """A discriminated union (e.g. a task lease's payload) by its tags, as `compare_kinds` treats the task
        unions' own files: a tag removed is breaking, a tag added is not (an older agent fails a task of a
        kind it does not know, by its reason), a tag kept is compared structurally."""
        for tag in sorted(old.keys() - new.keys()):
            self._add(path, f"kind {tag!r} removed")
        for tag in sorted(new.keys() - old.keys()):
            self._add(path, f"kind {tag!r} added (deploy agents first)", breaking=False)
        for tag in sorted(old.keys() & new.keys()):
            self.compare({"$ref": old[tag]}, {"$ref": new[tag]}, f"{path}<{tag}>")

    def _compare_same_kind(self, old: Schema, new: Schema, kind: str, path: str) -> None:
        self._compare_values(old, new, path)
        for keyword in CONSTRAINT_KEYWORDS:
            if old.get(keyword) != new.get(keyword):
                self._add(path, f"constraint {keyword!r} changed from {old.get(keyword)!r} to {new.get(keyword)!r}")
        if kind == "object":
            self._compare_object(old, new, path)
        elif kind == "array":
            self.compare(_subschema(old.get("items")), _subschema(new.get("items")), f"{path}[]")

    def _compare_values(self, old: Schema, new: Schema, path: str) -> None:
        before, after = _allowed_values(old), _allowed_values(new)
        if before is None and after is None:
            return
        if before is None:
            self._add(path, f"now restricted to {sorted(after or [], key=repr)}")
        elif after is None:
            self._add(path, f"no longer restricted to {sorted(before, key=repr)}")
        else:
            for value in sorted(before - after, key=repr):
                self._add(path, f"enum value {value!r} removed")
            for value in sorted(after - before, key=repr):
                self._add(path, f"enum value {value!r} added (deploy consumers first)", breaking=False)

    def _compare_object(self, old: Schema, new: Schema, path: str) -> None:
        old_props, new_props = old.get("properties", {}), new.get("properties", {})
        old_required, new_required = set(old.get("required", ())), set(new.get("required", ()))
        for name in old_props:
            where = f"{path}.{name}" if path else name
            if name not in new_props:
                self._add(where, "field removed")
                continue
            if name in new_required and name not in old_required:
                self._add(where, "optional field became required")
            self.compare(old_props[name], new_props[name], where)
        for name in new_props.keys() - old_props.keys():
            where = f"{path}.{name}" if path else name
            if name in new_required:
                self._add(where, "new required field")
            else:
                self._add(where, "optional field added", breaking=False)
        old_extra, new_extra = old.get("additionalProperties"), new.get("additionalProperties")
        if isinstance(old_extra, Mapping) or isinstance(new_extra, Mapping):
            self.compare(_subschema(old_extra), _subschema(new_extra), f"{path}{{*}}")


# --- schema normalisation -------------------------------------------------------------------


def _resolve_pointer(root: Schema, ref: str) -> Schema:
    if not ref.startswith("#/"):
        raise ValueError(f"only local $refs are supported, got {ref!r}")
    node: Any = root
    for token in ref[2:].split("/"):
        node = node[token.replace("~1", "/").replace("~0", "~")]
    return node


def _resolve(root: Schema, node: Schema) -> tuple[str | None, Schema]:
    """Follow `$ref` (and single-element `allOf`) to the definition; siblings are merged in."""
    ref: str | None = None
    seen: set[str] = set()
    while True:
        if "$ref" in node:
            target: str = node["$ref"]
            if target in seen:
                raise ValueError(f"$ref cycle at {target!r}")
            seen.add(target)
            ref = target
            siblings = {k: v for k, v in node.items() if k != "$ref"}
            node = {**_resolve_pointer(root, target), **siblings}
        elif isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
            siblings = {k: v for k, v in node.items() if k != "allOf"}
            node = {**node["allOf"][0], **siblings}
        else:
            return ref, node


def _tags(node: Schema) -> Mapping[str, str] | None:
    """A discriminated union's tag -> `$ref` mapping (None: not one)."""
    discriminator = node.get("discriminator")
    mapping = cast(Mapping[str, Any], discriminator).get("mapping") if isinstance(discriminator, Mapping) else None
    return cast(Mapping[str, str], mapping) if isinstance(mapping, Mapping) else None


def _alternatives(root: Schema, node: Schema) -> list[tuple[str | None, Schema]]:
    """A schema as a flat list of single-type alternatives (anyOf/oneOf and type lists split)."""
    ref, node = _resolve(root, node)
    for keyword in ("anyOf", "oneOf"):
        if isinstance(node.get(keyword), list):
            return [alt for sub in node[keyword] for alt in _alternatives(root, sub)]
    types = node.get("type")
    if isinstance(types, list):
        return [(ref, {**node, "type": t}) for t in cast(list[str], types)]
    return [(ref, node)]


_JSON_TYPES: dict[type, str] = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}


def _kind(node: Schema) -> str:
    if isinstance(node.get("type"), str):
        return node["type"]
    values = _allowed_values(node)
    if values:
        kinds = {_JSON_TYPES.get(type(cast(object, v)), "object") for v in values}
        return kinds.pop() if len(kinds) == 1 else "mixed"
    if "properties" in node or "additionalProperties" in node:
        return "object"
    if "items" in node:
        return "array"
    return "any"


def _allowed_values(node: Schema) -> set[Any] | None:
    if "const" in node:
        return {_hashable(node["const"])}
    if isinstance(node.get("enum"), list):
        return {_hashable(v) for v in node["enum"]}
    return None


def _hashable(value: Any) -> Any:
    return repr(cast(object, value)) if isinstance(value, dict | list) else value


def _subschema(value: Any) -> Schema:
    return cast(Schema, value) if isinstance(value, Mapping) else {}


def _pair(olds: list[Any], news: list[Any]) -> list[tuple[Any, Any]]:
    """Pair alternatives of one kind: by title when several and each has its own, else positionally."""
    if len(olds) == 1 and len(news) == 1:
        return [(olds[0], news[0])]
    titles = [alt[1].get("title") for alt in news]
    by_title = {alt[1].get("title"): alt for alt in news}
    pairs = [(alt, by_title[alt[1].get("title")]) for alt in olds if alt[1].get("title") in by_title]
    # untitled or same-titled alternatives (e.g. an IPv4 and an IPv6 string): positional
    if len(pairs) < len(olds) or None in titles or len(set(titles)) < len(titles):
        pairs = list(zip(olds, news, strict=False))
    return pairs


def _describe_kind_change(before: set[str], after: set[str]) -> str:
    if before - {"null"} == after - {"null"}:
        return "may now be null" if "null" in after else "may no longer be null"
    return f"type changed from {'|'.join(sorted(before))} to {'|'.join(sorted(after))}"
