"""A typed config model built from the manifest's `inputs` JSON Schema (Juju ops' typed config): handlers get
`ctx.config.partition` instead of `instance.config["partition"]`. The platform validated the config against
the same schema at deploy, so building the model cannot fail on what the platform accepted.

    Config = config_model(json.loads(Path("manifest.json").read_text())["inputs"])
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, create_model

_SCALARS: dict[str, Any] = {"string": str, "integer": int, "number": float, "boolean": bool}


class ConfigBase(BaseModel):
    """Fields not in the schema are kept (`extra="allow"`): a newer manifest never breaks an older controller."""

    model_config = ConfigDict(extra="allow", frozen=True)


def _type_of(prop: dict[str, Any]) -> Any:
    if "enum" in prop:
        return Literal[tuple(prop["enum"])]
    kind = prop.get("type", "string")
    if isinstance(kind, list):  # ["string", "null"]
        kinds = [str(k) for k in cast(list[object], kind) if k != "null"]
        base = _type_of({**prop, "type": kinds[0] if kinds else "string"})
        return base | None if "null" in kind else base
    if kind == "array":
        return list[_type_of(prop.get("items") or {})] if prop.get("items") else list[Any]
    if kind == "object":
        return dict[str, Any]
    return _SCALARS.get(kind, Any)


def _field_name(name: str) -> str:
    return re.sub(r"\W", "_", name) if not name.isidentifier() else name


def config_model(schema: dict[str, Any] | None, name: str = "Config") -> type[ConfigBase]:
    """A frozen pydantic model with one field per property of `schema` (required ones without default)."""
    schema = schema or {}
    required = set(schema.get("required", []))
    fields: dict[str, Any] = {}
    properties: dict[str, dict[str, Any]] = schema.get("properties") or {}
    for prop_name, prop in properties.items():
        typ = _type_of(prop)
        extra: dict[str, Any] = {"description": prop["description"]} if "description" in prop else {}
        alias: dict[str, Any] = {"alias": prop_name} if _field_name(prop_name) != prop_name else {}
        if prop_name in required:
            fields[_field_name(prop_name)] = (typ, Field(..., **extra, **alias))
        else:
            fields[_field_name(prop_name)] = (typ | None, Field(prop.get("default"), **extra, **alias))
    return create_model(name, __base__=ConfigBase, **fields)


def manifest_inputs(path: str | Path) -> dict[str, Any]:
    """The `inputs` schema of a manifest file (the JSON you register with `Client.register_app`)."""
    inputs: dict[str, Any] = json.loads(Path(path).read_text()).get("inputs") or {}
    return inputs
