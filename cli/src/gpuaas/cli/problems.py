"""How a problem answered by the platform (RFC 9457 problem+json) reads on the terminal.

The first line is `error: <detail> (<code>, HTTP <status>)`. A validation problem says which field was refused and
why on one line per field, from whichever list the problem carries:

- `errors: [{loc, msg, type}]`: request validation in every service (gpuaas.kit.errors), `loc` starting with where
  the value came from (`body`, `query`, `path`, `header`, `cookie`);
- `errors: [{path, message}]`: an app's inputs checked against its manifest's JSON Schema (app-runtime);
- `invalid_params: [{name, reason}]`: RFC 9457's own example member, for any service that answers it.
"""

from __future__ import annotations

from typing import Any, cast

_SOURCES = ("body", "query", "path", "header", "cookie")


def headline(status: int, problem: dict[str, Any]) -> str:
    detail = problem.get("detail") or problem.get("title") or ""
    return f"{detail} ({problem.get('code', 'unknown')}, HTTP {status})"


def field_errors(problem: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, reason) for every field the problem names, in the order the service listed them."""
    found: list[tuple[str, str]] = []
    for item in _items(problem.get("errors")):
        if "loc" in item:
            found.append((_field_of_loc(item["loc"]), _text(item.get("msg") or item.get("type"))))
        elif "path" in item:
            found.append((_dotted(item["path"]) or "(the whole value)", _text(item.get("message"))))
    for item in _items(problem.get("invalid_params")):
        found.append((_text(item.get("name")) or "(unnamed)", _text(item.get("reason"))))
    return found


def render(status: int, problem: dict[str, Any]) -> list[str]:
    """The lines printed for a problem: the headline, then `  <field>: <reason>` per refused field."""
    return [headline(status, problem), *(f"  {name}: {reason}" for name, reason in field_errors(problem))]


def _items(value: object) -> list[dict[str, Any]]:
    return [cast(dict[str, Any], item) for item in _seq(value) or [] if isinstance(item, dict)]


def _seq(value: object) -> list[object] | None:
    """A JSON array as a list; None for anything else."""
    if isinstance(value, list | tuple):
        return list(cast("list[object] | tuple[object, ...]", value))
    return None


def _field_of_loc(loc: object) -> str:
    parts = _seq(loc)
    if parts is None:
        parts = [loc]
    if parts and parts[0] in _SOURCES:
        source, rest = parts[0], parts[1:]
        return f"{_dotted(rest)} ({source})" if rest else f"the request {source}"
    return _dotted(parts) or "(the request)"


def _dotted(path: object) -> str:
    parts = _seq(path)
    if parts is None:
        return _text(path)
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(parts))


def _text(value: object) -> str:
    return "" if value is None else str(value)
