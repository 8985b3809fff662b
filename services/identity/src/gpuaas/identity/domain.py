"""Identity's rules without I/O: which roles fit which scope, where a finished SSO login may send the
browser, and the PKCE (RFC 7636 S256) binding of an SSO login code to the client that started it."""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from authlib.oauth2.rfc7636 import create_s256_code_challenge

from gpuaas.contracts.enums import Role
from gpuaas.identity.settings import Settings
from gpuaas.kit.problems import Problem

PROJECT_ROLES = frozenset({Role.project_admin, Role.project_member, Role.viewer})
TENANT_ROLES = frozenset({Role.tenant_admin, *PROJECT_ROLES})
# Roles a federated user may get just in time (an IdP's default role): never tenant admin.
JIT_ROLES = PROJECT_ROLES


class InvalidReturnTo(Problem):
    status, code, title = 400, "invalid_return_to", "Invalid return_to"


class CodeChallengeRequired(Problem):
    status, code, title = 400, "code_challenge_required", "PKCE code challenge required"


class InvalidCodeChallenge(Problem):
    status, code, title = 400, "invalid_code_challenge", "Invalid PKCE code challenge"


# RFC 7636: an S256 challenge is the base64url (unpadded) SHA-256 of the verifier, 43 characters; a
# verifier is 43-128 characters of the unreserved set.
S256_CHALLENGE = re.compile(r"[A-Za-z0-9_-]{43}")
CODE_VERIFIER = re.compile(r"[A-Za-z0-9._~-]{43,128}")


def email_domain(email: str) -> str:
    return email.rsplit("@", 1)[1].lower()


def validate_client_challenge(
    return_to: str | None, code_challenge: str | None, code_challenge_method: str | None
) -> str | None:
    """The starting client's PKCE challenge, which binds the login code handed to `return_to` to that
    client: whoever sees the redirect URL (history, logs, a referrer) cannot redeem the code without the
    verifier. Required with `return_to` (the console and the CLI both send one); S256 only; meaningless
    without `return_to` (the callback then answers the tokens itself)."""
    if code_challenge is None and code_challenge_method is None:
        if return_to is not None:
            raise CodeChallengeRequired(
                "a login with return_to needs code_challenge (S256 of a random code_verifier, RFC 7636) "
                "and code_challenge_method=S256"
            )
        return None
    if return_to is None:
        raise InvalidCodeChallenge("code_challenge binds the login code handed to return_to: pass return_to")
    if code_challenge_method != "S256":
        raise InvalidCodeChallenge("code_challenge_method must be S256 (the only method supported)")
    if code_challenge is None or not S256_CHALLENGE.fullmatch(code_challenge):
        raise InvalidCodeChallenge("code_challenge must be the 43-character base64url S256 of the code_verifier")
    return code_challenge


def verifier_matches(code_challenge: str, code_verifier: str | None) -> bool:
    return (
        code_verifier is not None
        and CODE_VERIFIER.fullmatch(code_verifier) is not None
        and hmac.compare_digest(create_s256_code_challenge(code_verifier), code_challenge)
    )


@dataclass(frozen=True)
class Redirect:
    """The SSO callback's answer when the login started with a `return_to`: send the browser there."""

    url: str


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def _is_api_path(path: str) -> bool:
    """Whether `path` reaches the API (`/api`, `/api/...`) as a server would route it: percent-escapes
    decoded (repeatedly: `%2561` is `%61` is `a`), empty and dot segments resolved, case ignored. A path
    that still has an escape after a few rounds is treated as the API (refused): no console page needs one."""
    for _ in range(3):
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    else:
        return True
    segments: list[str] = []
    for seg in path.replace("\\", "/").split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if segments:
                segments.pop()
            continue
        segments.append(seg)
    return bool(segments) and segments[0].strip().lower() == "api"


def validate_return_to(settings: Settings, value: str) -> str:
    """Where a finished SSO login may send the browser (never an open redirect):
    - the platform's own origin (that of `public_url`, or one of `sso_return_origins`), outside `/api/`:
      the console; a path alone (`/...`) means the platform's own origin;
    - the CLI's loopback listener, `http://127.0.0.1:<port>/...` or `http://[::1]:<port>/...` (RFC 8252).
    Anything else (another host, userinfo tricks, backslashes, other schemes, no explicit loopback port)
    is refused with `invalid_return_to`."""
    if not value or len(value) > 2000 or not value.isprintable() or "\\" in value:
        raise InvalidReturnTo("return_to must be a plain URL")
    if value.startswith("/") and not value.startswith("//"):
        value = _origin(settings.public_url) + value
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        raise InvalidReturnTo("return_to has an invalid port") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
        raise InvalidReturnTo("return_to must be an http(s) URL without credentials")
    allowed = {_origin(settings.public_url), *(_origin(o) for o in settings.sso_return_origins)}
    if _origin(value) in allowed:
        if _is_api_path(parts.path):
            raise InvalidReturnTo("return_to must be a console page, not an API path")
        return value
    if parts.scheme == "http" and parts.hostname in ("127.0.0.1", "::1") and port is not None:
        return value  # the CLI's loopback redirect
    raise InvalidReturnTo("return_to must be this platform's console or a loopback (127.0.0.1) address")


def with_query(url: str, params: dict[str, str]) -> str:
    """`url` with `params` set in its query (other parameters and the fragment kept)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in params]
    return urlunsplit(parts._replace(query=urlencode([*query, *params.items()])))
