"""How commands print: a rich table (or a line) by default, or with `--json` what the API answered.

Typed answers of the SDK are printed back as the API's JSON (`plain`), and table cells and dates read the
same way (a date as the API wrote it, an id as text), so the output does not depend on the SDK's types.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from decimal import Decimal, InvalidOperation
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from pydantic_core import to_jsonable_python
from rich.console import Console
from rich.table import Table

D = TypeVar("D")
out = Console()
err = Console(stderr=True)


@runtime_checkable
class JsonView(Protocol):
    """What a command shows that is more than one answer (an allocation with its timeline, ...)."""

    def as_json(self) -> Any: ...


def plain(data: Any) -> Any:
    """JSON-ready data: models as the API answered them, lists and dicts element by element."""
    if isinstance(data, JsonView):
        return data.as_json()
    if isinstance(data, list | tuple):
        return [plain(item) for item in cast(Iterable[object], data)]
    if isinstance(data, dict):
        return {key: plain(value) for key, value in cast(dict[object, object], data).items()}
    return to_jsonable_python(data, by_alias=True)


def text(value: Any) -> str:
    """One value as the API wrote it (e.g. a date in ISO 8601 with `Z`); None is empty."""
    return "" if value is None else str(plain(value))


class OutputMode(Protocol):
    """What output needs of the CLI's global state (`--json`), so it does not import the context."""

    json: bool


def emit(st: OutputMode, data: D, render: Callable[[D], Any] | None = None) -> None:
    if st.json or render is None:
        out.print_json(json.dumps(plain(data), default=str))
    else:
        render(data)


def table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    for row in rows:
        t.add_row(*(text(v) for v in row))
    return t


def money(amount: Any, currency: str) -> str:
    """An amount with its currency, never a bare number: at least two decimals, the ledger's further digits
    only where they are not zero (`5.00 USD`, `0.000702 USD`)."""
    try:
        d = Decimal(str(amount))
    except InvalidOperation:
        return f"{amount} {currency}"
    text = format(d.normalize(), "f")
    whole, _, frac = text.partition(".")
    return f"{whole}.{frac.ljust(2, '0')} {currency}"
