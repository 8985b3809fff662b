"""Where a finished SSO login may send the browser: the platform's console or the CLI's loopback
listener, nothing else (no open redirect); and how the result is added to that address."""

from __future__ import annotations

import pytest

from gpuaas.identity.domain import InvalidReturnTo, validate_return_to, with_query
from gpuaas.identity.settings import Settings

SETTINGS = Settings(
    public_url="https://gpu.example.com/api/identity", sso_return_origins=["https://console.example.net"]
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("https://gpu.example.com/", "https://gpu.example.com/"),
        ("https://gpu.example.com/?sso=n#/allocations", "https://gpu.example.com/?sso=n#/allocations"),
        ("/?sso=n", "https://gpu.example.com/?sso=n"),
        ("https://console.example.net/login", "https://console.example.net/login"),
        ("http://127.0.0.1:50123/callback?cli_state=x", "http://127.0.0.1:50123/callback?cli_state=x"),
        ("http://[::1]:50123/callback", "http://[::1]:50123/callback"),
    ],
)
def test_console_and_loopback_are_allowed(value: str, expected: str) -> None:
    assert validate_return_to(SETTINGS, value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "https://evil.example/",
        "//evil.example/",
        "https://gpu.example.com.evil.example/",
        "https://gpu.example.com@evil.example/",
        "https://user:pw@gpu.example.com/",
        "http://gpu.example.com/",  # another scheme is another origin
        "https://gpu.example.com/api/identity/me",
        "https://gpu.example.com/api",
        "http://127.0.0.1/callback",  # a loopback redirect names its port
        "https://127.0.0.1:5000/callback",
        "http://localhost:5000/callback",
        "http://127.0.0.1:99999/callback",
        "javascript:alert(1)",
        "/\\evil.example",
        "https://gpu.example.com/\nLocation: x",
        "",
    ],
)
def test_anything_else_is_refused(value: str) -> None:
    with pytest.raises(InvalidReturnTo) as refused:
        validate_return_to(SETTINGS, value)
    assert refused.value.code == "invalid_return_to" and refused.value.status == 400


def test_result_joins_the_query_and_keeps_the_fragment() -> None:
    url = with_query("https://gpu.example.com/?sso=n&login_code=old#/x", {"login_code": "slc_new"})
    assert url == "https://gpu.example.com/?sso=n&login_code=slc_new#/x"
    assert with_query("http://127.0.0.1:5/cb", {"error": "idp_denied"}) == "http://127.0.0.1:5/cb?error=idp_denied"
