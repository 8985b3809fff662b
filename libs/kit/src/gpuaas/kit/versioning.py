"""Optimistic concurrency for the APIs (ARCHITECTURE §11): resources carry a `version`; a GET answers it as
an `ETag` and a mutation may send `If-Match` with it. A mismatch is 412 `version_mismatch`, checked
under the row lock of the use case, so of two writers that read the same version only one wins.

One way everywhere: the router takes `expected: ExpectedVersion` (the parsed If-Match, None when absent)
and passes it to the use case as `expected_version=`; the use case calls `check_version` after its
SELECT ... FOR UPDATE; the router answers the new version with `set_etag`.

    @router.post("/things/{id}/resize")
    async def resize(id: UUID, body: Resize, response: Response, expected: ExpectedVersion, ...):
        state = await service.resize(session, principal, id, body, expected_version=expected)
        set_etag(response, state.version)
        return state
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Response

from gpuaas.kit.errors import PreconditionFailed, Unprocessable

IfMatch = Annotated[
    str | None,
    Header(
        description='The resource version the change is based on (its ETag, e.g. "3"); 412 if it moved on',
        max_length=40,
    ),
]


def expected_version(if_match: str | None) -> int | None:
    """The version an If-Match header names (`"3"`, `W/"3"` or `3`); None when absent or `*`."""
    if if_match is None or if_match.strip() == "*":
        return None
    value = if_match.strip().removeprefix("W/").strip('"')
    try:
        version = int(value)
    except ValueError:
        raise Unprocessable('If-Match must carry the resource version, e.g. "3"', code="if_match_invalid") from None
    if version < 1:
        raise Unprocessable("If-Match names a version from 1 up", code="if_match_invalid")
    return version


def check_version(current: int, expected: int | None) -> None:
    if expected is not None and expected != current:
        raise PreconditionFailed(
            f"the resource is at version {current}, not {expected}; re-read it and retry",
            code="version_mismatch",
        )


def etag(version: int) -> str:
    return f'"{version}"'


def set_etag(response: Response, version: int) -> None:
    response.headers["ETag"] = etag(version)


def _expected_from_header(if_match: IfMatch = None) -> int | None:
    return expected_version(if_match)


# The If-Match of the request as the version it names (None: no precondition). The one dependency for it.
ExpectedVersion = Annotated[int | None, Depends(_expected_from_header)]
