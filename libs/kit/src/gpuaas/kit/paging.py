"""Cursor (keyset) paging for list endpoints, one convention for every service.

A list endpoint keeps its body as it was (a JSON array, or `{"items": [...]}`) and takes
`?limit=&cursor=`. When more rows follow, the response carries

    Link: <?...&cursor=OPAQUE>; rel="next"

a relative reference (RFC 3986 §4.2, a query only) to the next page: the request's own query with
`cursor` replaced, so it resolves against whatever URL the client called (the gateway's or the
service's). No `Link` header: this is the last page. Clients: `httpx` exposes it as
`response.links["next"]["url"]`; resolve it with `urljoin(str(response.url), ...)`.

The cursor is the sort key of the last row returned (base64url JSON), and the next page is
`WHERE (k1, k2) < (cursor)` on an index in that order, so a page costs the same whatever its depth,
and rows inserted meanwhile never shift or repeat the rows that follow (newest-first lists: new
rows land before the first page). A cursor that does not decode is `400 invalid_cursor`.
"""

# No `from __future__ import annotations`: FastAPI must see page_params' Query bounds (closure values).
import base64
import binascii
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, NoReturn, TypeVar, cast
from urllib.parse import urlencode

from fastapi import Query, Request, Response
from sqlalchemy import ColumnElement, Select, literal, tuple_

from gpuaas.kit.problems import Problem

T = TypeVar("T")


class InvalidCursor(Problem):
    status, code, title = 400, "invalid_cursor", "Invalid paging cursor"


@dataclass(frozen=True)
class PageRequest:
    limit: int
    cursor: str | None = None


def page_params(default: int = 100, maximum: int = 1000) -> Callable[..., PageRequest]:
    """A FastAPI dependency reading `?limit=` (1..maximum, default `default`) and `?cursor=`."""

    def dependency(
        limit: Annotated[int, Query(ge=1, le=maximum, description="Rows per page.")] = default,
        cursor: Annotated[
            str | None, Query(max_length=512, description='From the previous page\'s `Link: <...>; rel="next"`.')
        ] = None,
    ) -> PageRequest:
        return PageRequest(limit=limit, cursor=cursor or None)

    return dependency


def _plain(v: Any) -> Any:
    if isinstance(v, datetime):
        return v.isoformat()
    if isinstance(v, uuid.UUID):
        return str(v)
    return v


def encode_cursor(*values: Any) -> str:
    raw = json.dumps([_plain(v) for v in values], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _not_text(v: object) -> NoReturn:
    raise ValueError(f"expected text, got {type(v).__name__}")


def decode_cursor(cursor: str, types: Sequence[type]) -> tuple[Any, ...]:
    """The cursor's values, converted to `types` (datetime, uuid.UUID, int, str); 400 if it is not one."""
    try:
        decoded: object = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if not isinstance(decoded, list):
            raise ValueError("not a list")
        values = cast(list[object], decoded)
        if len(values) != len(types):
            raise ValueError("wrong arity")
        out: list[Any] = []
        for v, t in zip(values, types, strict=True):
            if t is datetime:
                out.append(datetime.fromisoformat(v) if isinstance(v, str) else _not_text(v))
            elif t is uuid.UUID:
                out.append(uuid.UUID(v) if isinstance(v, str) else _not_text(v))
            elif (t is int and isinstance(v, int) and not isinstance(v, bool)) or (t is str and isinstance(v, str)):
                out.append(v)
            else:
                raise ValueError(f"unexpected {type(v).__name__}")
        return tuple(out)
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError) as exc:
        raise InvalidCursor(f"cursor is not one this list issued ({exc})") from None


def keyset(stmt: Select[Any], keys: Sequence[ColumnElement[Any]], page: PageRequest) -> Select[Any]:
    """`stmt` ordered by `keys` descending, after the page's cursor, limited to limit + 1 rows (the
    extra row says whether a next page exists; `split` drops it)."""
    if page.cursor:
        values = decode_cursor(page.cursor, [k.type.python_type for k in keys])
        bound = [literal(v, type_=k.type) for v, k in zip(values, keys, strict=True)]
        stmt = stmt.where(tuple_(*keys) < tuple_(*bound))
    return stmt.order_by(*(k.desc() for k in keys)).limit(page.limit + 1)


def split(rows: Sequence[T], page: PageRequest, key: Callable[[T], Sequence[Any]]) -> tuple[list[T], str | None]:
    """The page's rows and the cursor of the next page (None on the last)."""
    if len(rows) <= page.limit:
        return list(rows), None
    kept = list(rows[: page.limit])
    return kept, encode_cursor(*key(kept[-1]))


def set_next_link(request: Request, response: Response, next_cursor: str | None, *, param: str = "cursor") -> None:
    """Add `Link: <?...>; rel="next"` when there is a next page (`param` is the query parameter that
    carries the cursor: `cursor`, or `after` for the seq-based timelines)."""
    if next_cursor is None:
        return
    query = [(k, v) for k, v in request.query_params.multi_items() if k != param]
    query.append((param, next_cursor))
    response.headers.append("Link", f'<?{urlencode(query)}>; rel="next"')
