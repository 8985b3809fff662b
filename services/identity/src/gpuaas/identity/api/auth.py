"""The OAuth2 token endpoint and logout: what every client (console, CLI, controllers) signs in with."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Form, Request, Response

from gpuaas.identity.api.deps import basic_auth, client_of, session_id_of
from gpuaas.identity.api.schemas import TokenResponse
from gpuaas.identity.service import logins, oidc_provider, sessions, sso
from gpuaas.identity.settings import Settings
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import Principal, bearer_token
from gpuaas.kit.errors import Problem, Unauthorized, Unprocessable

router = APIRouter()


@router.post("/auth/token", response_model=TokenResponse, response_model_exclude_none=True, tags=["auth"])
async def token(
    request: Request,
    kit: Kit,
    grant_type: Annotated[str, Form(max_length=100)],
    username: Annotated[str | None, Form(max_length=320)] = None,
    password: Annotated[str | None, Form(max_length=256)] = None,
    refresh_token: Annotated[str | None, Form(max_length=200)] = None,
    client_id: Annotated[str | None, Form(max_length=200)] = None,
    client_secret: Annotated[str | None, Form(max_length=200)] = None,
    scope: Annotated[str | None, Form(max_length=1000)] = None,
    code: Annotated[str | None, Form(max_length=200)] = None,
    redirect_uri: Annotated[str | None, Form(max_length=500)] = None,
    code_verifier: Annotated[str | None, Form(max_length=200)] = None,
) -> Any:
    """The OAuth2 token endpoint: `password` (local users), `refresh_token` (rotating),
    `client_credentials` (project service accounts; HTTP Basic or form), `authorization_code` (+PKCE),
    `sso_login_code` (the single-use `code` a finished SSO login handed to its `return_to`, with the
    `code_verifier` of the S256 challenge its start carried; a missing or wrong one is `invalid_grant`
    and spends the code)."""
    settings = kit.settings_as(Settings)
    if grant_type == "password":
        if not username or password is None:
            raise Unprocessable("username and password are required", code="invalid_request")
        return await logins.password_login(
            kit.sessions, settings, email=username, password=password, client=client_of(request, kit)
        )
    if grant_type == oidc_provider.SSO_LOGIN_CODE_GRANT:
        if not code:
            raise Unprocessable("code is required", code="invalid_request")
        return await sso.exchange_login_code(
            kit.sessions, settings, code=code, code_verifier=code_verifier, client=client_of(request, kit)
        )
    if grant_type == "refresh_token":
        if not refresh_token:
            raise Unprocessable("refresh_token is required", code="invalid_request")
        return await sessions.refresh(kit.sessions, settings, refresh_token=refresh_token)
    basic_id, basic_secret = basic_auth(request)
    client_id, client_secret = basic_id or client_id, basic_secret or client_secret
    if grant_type == "client_credentials":
        if not client_id or not client_secret:
            raise Unauthorized("client_id and client_secret are required", code="invalid_client")
        return await logins.client_credentials(
            kit.sessions,
            settings,
            client_id=client_id,
            client_secret=client_secret,
            scope=scope,
            client=client_of(request, kit),
        )
    if grant_type == "authorization_code":
        if not code:
            raise Unprocessable("code is required", code="invalid_request")
        return await oidc_provider.exchange_code(
            kit.sessions,
            settings,
            code=code,
            redirect_uri=redirect_uri,
            code_verifier=code_verifier,
            client_id=client_id,
            client_secret=client_secret,
        )
    raise Problem(f"unsupported grant_type {grant_type!r}", code="unsupported_grant_type")


@router.post("/auth/logout", status_code=204, tags=["auth"])
async def logout(
    request: Request, kit: Kit, refresh_token: Annotated[str | None, Form(max_length=200)] = None
) -> Response:
    """End the session of the presented access token (Authorization header) or refresh token."""
    principal: Principal | None = None
    session_id = None
    if raw := bearer_token(request):
        principal = await kit.verifier.verify(raw)
        session_id = session_id_of(raw)
    await sessions.logout(kit.sessions, principal=principal, session_id=session_id, refresh_token=refresh_token)
    return Response(status_code=204)
