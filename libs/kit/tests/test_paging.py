"""kit.paging: cursors round-trip their sort keys, refuse anything else, and the next link keeps the query."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from fastapi import FastAPI, Request, Response
from fastapi.testclient import TestClient

from gpuaas.kit.paging import InvalidCursor, PageRequest, decode_cursor, encode_cursor, set_next_link, split


def test_cursor_round_trip_and_refusals() -> None:
    at, ident = datetime(2026, 11, 24, 6, 0, 0, 123456, tzinfo=UTC), uuid.uuid4()
    cursor = encode_cursor(at, ident, 7)
    assert "=" not in cursor and decode_cursor(cursor, [datetime, uuid.UUID, int]) == (at, ident, 7)
    for bad, types in (
        ("%%%", [int]),
        (encode_cursor(1, 2), [int]),  # arity
        (encode_cursor("x"), [int]),  # type
        (encode_cursor(True), [int]),
        (encode_cursor("not-a-uuid"), [uuid.UUID]),
        (encode_cursor("yesterday"), [datetime]),
    ):
        with pytest.raises(InvalidCursor):
            decode_cursor(bad, types)


def test_split_keeps_limit_and_points_at_the_last_row() -> None:
    rows = list(range(10, 0, -1))
    kept, nxt = split(rows, PageRequest(limit=4), lambda r: (r,))
    assert kept == [10, 9, 8, 7] and nxt is not None and decode_cursor(nxt, [int]) == (7,)
    assert split(rows[:4], PageRequest(limit=4), lambda r: (r,)) == ([10, 9, 8, 7], None)


def test_next_link_is_a_relative_query_with_the_other_parameters() -> None:
    app = FastAPI()

    @app.get("/items")
    def items(request: Request, response: Response) -> list[int]:
        set_next_link(request, response, None if request.query_params.get("last") else "abc")
        return [1]

    client = TestClient(app)
    r = client.get("/items", params={"include_released": "true", "limit": "2", "cursor": "old"})
    assert r.json() == [1]
    assert r.headers["link"] == '<?include_released=true&limit=2&cursor=abc>; rel="next"'
    assert r.links["next"]["url"] == "?include_released=true&limit=2&cursor=abc"
    assert "link" not in client.get("/items", params={"last": "1"}).headers
