"""Identity rules without I/O (gpuaas.identity.domain) beside return_to (test_sso_return_to): the PKCE (RFC 7636
S256) binding of an SSO login code to the client that started the login, and which roles fit which scope."""

from __future__ import annotations

import base64
import hashlib
import secrets

import pytest

from gpuaas.contracts.enums import Role
from gpuaas.identity.domain import (
    JIT_ROLES,
    PROJECT_ROLES,
    TENANT_ROLES,
    CodeChallengeRequired,
    InvalidCodeChallenge,
    email_domain,
    validate_client_challenge,
    verifier_matches,
)
from gpuaas.kit.problems import Problem

RETURN_TO = "http://127.0.0.1:53682/callback"


def s256(verifier: str) -> str:
    """RFC 7636 §4.2, written out here rather than borrowed from the library the code uses."""
    return base64.urlsafe_b64encode(hashlib.sha256(verifier.encode("ascii")).digest()).decode().rstrip("=")


def test_the_rfc_7636_appendix_b_example_verifies() -> None:
    verifier = "dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"
    challenge = "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"
    assert validate_client_challenge(RETURN_TO, challenge, "S256") == challenge
    assert verifier_matches(challenge, verifier)


def test_a_random_verifier_matches_only_its_own_challenge() -> None:
    verifier = secrets.token_urlsafe(64)
    assert verifier_matches(s256(verifier), verifier)
    assert not verifier_matches(s256(verifier), secrets.token_urlsafe(64))
    assert not verifier_matches(s256(verifier), None)  # a redeem without the verifier


@pytest.mark.parametrize(
    "verifier",
    [
        "a" * 42,  # RFC 7636: 43 to 128 characters
        "a" * 129,
        "a" * 42 + "+",  # outside the unreserved set
        "a" * 42 + " ",
    ],
)
def test_a_malformed_verifier_never_matches_even_its_own_hash(verifier: str) -> None:
    assert not verifier_matches(s256(verifier), verifier)


@pytest.mark.parametrize("verifier", ["a" * 43, "a" * 128, "Az09-._~" * 6])
def test_verifier_lengths_and_characters_of_the_rfc_are_accepted(verifier: str) -> None:
    assert verifier_matches(s256(verifier), verifier)


def test_a_login_without_return_to_needs_no_challenge() -> None:
    assert validate_client_challenge(None, None, None) is None


def test_a_login_with_return_to_needs_a_challenge() -> None:
    with pytest.raises(CodeChallengeRequired) as caught:
        validate_client_challenge(RETURN_TO, None, None)
    assert (caught.value.status, caught.value.code) == (400, "code_challenge_required")


@pytest.mark.parametrize(
    ("return_to", "challenge", "method"),
    [
        (None, s256("x" * 43), "S256"),  # a challenge binds the code handed to return_to: meaningless without one
        (RETURN_TO, s256("x" * 43), "plain"),  # S256 only
        (RETURN_TO, s256("x" * 43), None),
        (RETURN_TO, s256("x" * 43), "s256"),
        (RETURN_TO, None, "S256"),
        (RETURN_TO, s256("x" * 43)[:42], "S256"),  # 43 characters exactly
        (RETURN_TO, s256("x" * 43) + "A", "S256"),
        (RETURN_TO, "+" * 43, "S256"),  # base64url, not base64
        (RETURN_TO, "=" * 43, "S256"),
    ],
)
def test_anything_but_an_s256_challenge_with_return_to_is_invalid(
    return_to: str | None, challenge: str | None, method: str | None
) -> None:
    with pytest.raises(InvalidCodeChallenge) as caught:
        validate_client_challenge(return_to, challenge, method)
    assert isinstance(caught.value, Problem)
    assert (caught.value.status, caught.value.code) == (400, "invalid_code_challenge")


def test_a_just_in_time_role_is_never_tenant_admin() -> None:
    assert Role.tenant_admin not in JIT_ROLES
    assert Role.tenant_admin in TENANT_ROLES and Role.tenant_admin not in PROJECT_ROLES
    assert PROJECT_ROLES < TENANT_ROLES
    assert Role.platform_admin not in TENANT_ROLES  # no tenant-scoped grant reaches the platform


def test_email_domains_compare_case_insensitively() -> None:
    assert email_domain("Ada@Example.ORG") == "example.org"
    assert email_domain('"odd@local"@corp.example') == "corp.example"  # the last @ separates the domain
