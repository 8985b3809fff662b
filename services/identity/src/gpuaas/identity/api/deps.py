"""What identity's routers share: the permission action a route declares, the caller's address,
HTTP Basic client credentials and the session id of a verified token."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any
from urllib.parse import unquote

from fastapi import Request
from joserfc import jws

from gpuaas.identity.credentials import Client
from gpuaas.identity.settings import Settings
from gpuaas.kit import iam
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.client_address import client_address
from gpuaas.kit.errors import Unauthorized


def action(name: str) -> dict[str, Any]:
    """Route kwargs declaring the permission action of a route whose authorization happens inside the
    use case (`x-gpuaas-action` in the OpenAPI document), like the kit does for `require(action)` routes."""
    iam.roles_allowed(name)  # fail at import on a typo
    return {"openapi_extra": {iam.ACTION_EXTENSION: name}}


def client_of(request: Request, kit: KitRuntime) -> Client:
    """The caller's address (login throttling, sessions, audit `source`): the peer, or, when the peer is a
    trusted proxy, the right-most X-Forwarded-For hop that is not one (`gpuaas.kit.client_address`)."""
    settings = kit.settings_as(Settings)
    peer = request.client.host if request.client else None
    ip = client_address(peer, request.headers.get("x-forwarded-for"), settings.trusted_proxies)
    return Client(ip=ip, user_agent=request.headers.get("user-agent"))


def basic_auth(request: Request) -> tuple[str | None, str | None]:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic" or not value:
        return None, None
    try:
        user, _, secret = base64.b64decode(value).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        raise Unauthorized("malformed basic credentials", code="invalid_client") from None
    return unquote(user), unquote(secret)


def session_id_of(token: str) -> uuid.UUID | None:
    """The `sid` claim of an already verified token."""
    try:
        payload = json.loads(jws.extract_compact(token.encode()).payload)
        return uuid.UUID(payload["sid"]) if payload.get("sid") else None
    except (ValueError, KeyError, TypeError):
        return None
