"""If-Match parsing, the `ExpectedVersion` router dependency and the version check every service's optimistic
concurrency uses."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Response

from gpuaas.kit.errors import PreconditionFailed, Unprocessable, install_error_handlers
from gpuaas.kit.versioning import ExpectedVersion, check_version, etag, expected_version, set_etag


@pytest.mark.parametrize(
    ("header", "version"), [('"3"', 3), ('W/"3"', 3), ("3", 3), (" 12 ", 12), ("*", None), (None, None)]
)
def test_if_match_names_a_version(header: str | None, version: int | None) -> None:
    assert expected_version(header) == version


@pytest.mark.parametrize("header", ['"abc"', '""', '"0"', '"-2"', "W/"])
def test_a_malformed_if_match_is_a_422_with_a_stable_code(header: str) -> None:
    with pytest.raises(Unprocessable) as exc:
        expected_version(header)
    assert exc.value.code == "if_match_invalid"


def test_a_moved_on_resource_is_a_412_and_the_etag_round_trips() -> None:
    check_version(4, None)
    check_version(4, expected_version(etag(4)))
    with pytest.raises(PreconditionFailed) as exc:
        check_version(5, 4)
    assert exc.value.status == 412 and exc.value.code == "version_mismatch"


# --- ExpectedVersion: the one router dependency, through a real app ---------------------------


def _versioned_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/things/{thing_id}/resize")
    async def resize(thing_id: str, response: Response, expected: ExpectedVersion) -> dict[str, int | None]:
        set_etag(response, 4)
        return {"expected": expected}

    return app


async def _resize(headers: dict[str, str]) -> httpx.Response:
    transport = httpx.ASGITransport(app=_versioned_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://svc") as client:
        return await client.post("/things/t1/resize", headers=headers)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"If-Match": '"3"'}, 3),
        ({"If-Match": 'W/"3"'}, 3),
        ({"If-Match": "3"}, 3),
        ({"If-Match": "*"}, None),
    ],
)
async def test_expected_version_dependency_parses_if_match(headers: dict[str, str], expected: int | None) -> None:
    r = await _resize(headers)
    assert r.status_code == 200, r.text
    assert r.json() == {"expected": expected}
    assert r.headers["etag"] == '"4"'


@pytest.mark.parametrize("value", ['"abc"', "abc", '"0"', '"-3"', 'W/"x"', '"1", "2"'])
async def test_expected_version_dependency_answers_a_bad_if_match_with_422(value: str) -> None:
    r = await _resize({"If-Match": value})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["code"] == "if_match_invalid"


async def test_expected_version_dependency_is_documented_as_the_if_match_header() -> None:
    params = _versioned_app().openapi()["paths"]["/things/{thing_id}/resize"]["post"]["parameters"]
    header = next(p for p in params if p["in"] == "header")
    assert header["name"] == "if-match" and header["required"] is False
    assert header["schema"]["anyOf"][0]["maxLength"] == 40
