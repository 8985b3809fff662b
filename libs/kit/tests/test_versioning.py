"""If-Match parsing and the version check every service's optimistic concurrency uses."""

from __future__ import annotations

import pytest

from gpuaas.kit.errors import PreconditionFailed, Unprocessable
from gpuaas.kit.versioning import check_version, etag, expected_version


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
