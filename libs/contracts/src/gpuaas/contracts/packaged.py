"""Where the JSON Schemas and the AsyncAPI document are, for readers of an installed package.

The wheel (`make contracts-wheel`) carries the committed schema directory as package data under
`gpuaas/contracts/jsonschemas/` (the same files as `libs/contracts/schemas/` in the repository):

    events/<topic>/<event type>.json   topics/<topic>.json   asyncapi.json
    agent/...                          the node agent protocol (`gpuaas.contracts.agent`)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PACKAGED = Path(__file__).resolve().parent / "jsonschemas"


def schema_dir() -> Path:
    """The packaged schema directory (installed wheel), else the repository's `libs/contracts/schemas`."""
    if PACKAGED.is_dir():
        return PACKAGED
    source = Path(__file__).resolve().parents[3] / "schemas"
    if source.is_dir():
        return source
    raise FileNotFoundError("no schema files: neither a wheel built by `make contracts-wheel` nor a source checkout")


def asyncapi_document() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of every topic, as shipped."""
    return json.loads((schema_dir() / "asyncapi.json").read_text(encoding="utf-8"))


def topic_schema(topic: str) -> dict[str, Any]:
    """The JSON Schema (2020-12) of a topic's union of events, as shipped."""
    return json.loads((schema_dir() / "topics" / f"{topic}.json").read_text(encoding="utf-8"))
