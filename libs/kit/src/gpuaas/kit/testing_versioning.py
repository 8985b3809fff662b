"""The If-Match checks every versioned service's tests make, written once (ARCHITECTURE §11, kit.versioning).

A service's `tests/test_versioning.py` supplies what is its own (the paths, the bodies, a `snapshot()` of
everything a change could write) and these assert the shared rules:

- a GET answers the resource's version as a strong ETag (`version_of`), and so does every change
  (`etag_version`);
- a stale If-Match is 412 `version_mismatch` (problem+json) and writes nothing (`assert_all_stale`);
- a malformed one is 422 `if_match_invalid` and writes nothing (`assert_all_malformed_rejected`);
- of two writers that read the same version exactly one wins (`exactly_one_wins`).

Requests are passed as callables (`lambda: client.post(...)`) so each is sent only when its turn comes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import httpx

from gpuaas.kit.versioning import etag

# If-Match values no service may accept: not a version, versions below 1, a weak tag of garbage, a list.
MALFORMED_IF_MATCH: tuple[str, ...] = ("abc", '"0"', '"-3"', 'W/"x"', '"1", "2"')

Send = Callable[[], Awaitable[httpx.Response]]
SendWith = Callable[[str], Awaitable[httpx.Response]]  # sends the request with this If-Match value
Snapshot = Callable[[], Awaitable[Any]]


def if_match(version: int | str) -> dict[str, str]:
    """The If-Match header: a version as its strong tag (`"3"`), or a raw header value as given."""
    return {"If-Match": etag(version) if isinstance(version, int) else version}


def assert_problem(r: httpx.Response, status: int, code: str, label: object = None) -> None:
    """`r` is an RFC 9457 problem with this status and stable code."""
    body: dict[str, Any] = r.json() if r.headers.get("content-type", "").endswith("json") else {}
    assert (r.status_code, body.get("code")) == (status, code), (label, r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/problem+json"), (label, r.headers["content-type"])


def assert_version_mismatch(r: httpx.Response, label: object = None) -> None:
    assert_problem(r, 412, "version_mismatch", label)


def assert_if_match_invalid(r: httpx.Response, label: object = None) -> None:
    assert_problem(r, 422, "if_match_invalid", label)


def etag_version(r: httpx.Response) -> int:
    """The version the response body carries, after checking that its ETag names exactly that version."""
    version = int(r.json()["version"])
    assert r.headers["etag"] == etag(version), (r.headers.get("etag"), version, r.text)
    return version


async def version_of(client: httpx.AsyncClient, path: str) -> int:
    """GET `path`: 200, and the ETag is the body's version (returned)."""
    r = await client.get(path)
    assert r.status_code == 200, r.text
    return etag_version(r)


async def assert_all_stale(snapshot: Snapshot, calls: Iterable[tuple[str, Send]]) -> None:
    """Each call, sent with a stale If-Match, is 412 `version_mismatch`, and nothing stored moved."""
    before = await snapshot()
    for label, send in calls:
        assert_version_mismatch(await send(), label)
    assert await snapshot() == before


async def assert_all_malformed_rejected(
    snapshot: Snapshot, calls: Iterable[tuple[str, SendWith]], values: Iterable[str] = MALFORMED_IF_MATCH
) -> None:
    """Each call, sent with each malformed If-Match value, is 422 `if_match_invalid`, and nothing stored moved."""
    calls = list(calls)
    before = await snapshot()
    for value in values:
        for label, send in calls:
            assert_if_match_invalid(await send(value), (label, value))
    assert await snapshot() == before


async def exactly_one_wins(ok: int, *sends: Send) -> tuple[httpx.Response, list[httpx.Response]]:
    """Send concurrently requests that carry the same If-Match: exactly one answers `ok`, every other 412.
    Returns the winner and the losers."""
    responses = await asyncio.gather(*(send() for send in sends))
    assert sorted(r.status_code for r in responses) == sorted([ok] + [412] * (len(sends) - 1)), [
        r.text for r in responses
    ]
    winner = next(r for r in responses if r.status_code == ok)
    losers = [r for r in responses if r is not winner]
    for loser in losers:
        assert_version_mismatch(loser, "a concurrent writer on the same version")
    return winner, losers
