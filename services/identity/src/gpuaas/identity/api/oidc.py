"""Identity as an OpenID Connect provider: discovery, JWKS, the authorization endpoint (login form),
userinfo, relying-party registration and signing-key rotation."""

from __future__ import annotations

import base64
import json
from typing import Annotated, Any

from fastapi import APIRouter, Form, Query, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from gpuaas.identity.api.deps import action, client_of
from gpuaas.identity.api.schemas import KeyRotation, OAuthClient, OAuthClientCreate
from gpuaas.identity.service import oidc_provider, signing_keys
from gpuaas.identity.settings import Settings
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal, TokenVerifier, bearer_token
from gpuaas.kit.errors import Problem, Unauthorized

router = APIRouter()


@router.get("/.well-known/jwks.json", tags=["oidc"])
async def jwks(kit: Kit, response: Response) -> dict[str, Any]:
    response.headers["Cache-Control"] = "public, max-age=60"
    async with kit.sessions() as session:
        return await oidc_provider.jwks(session, kit.settings_as(Settings))


@router.get("/.well-known/openid-configuration", tags=["oidc"])
async def discovery(kit: Kit) -> dict[str, Any]:
    return oidc_provider.discovery_document(kit.settings_as(Settings).public_url)


def _authorize_params(values: dict[str, Any]) -> dict[str, str | None]:
    return {k: (str(values[k]) if values.get(k) is not None else None) for k in oidc_provider.AUTHORIZE_PARAMS}


@router.get("/oauth/authorize", response_class=HTMLResponse, tags=["oidc"])
async def authorize_form(
    kit: Kit,
    response_type: Annotated[str, Query(max_length=20)],
    client_id: Annotated[str, Query(max_length=200)],
    redirect_uri: Annotated[str, Query(max_length=500)],
    scope: Annotated[str, Query(max_length=500)] = "openid",
    state: Annotated[str | None, Query(max_length=500)] = None,
    nonce: Annotated[str | None, Query(max_length=500)] = None,
    code_challenge: Annotated[str | None, Query(max_length=200)] = None,
    code_challenge_method: Annotated[str | None, Query(max_length=10)] = None,
    login_hint: Annotated[str | None, Query(max_length=320)] = None,
) -> Any:
    if response_type != "code":
        raise oidc_provider.InvalidAuthorizeRequest(
            "only response_type=code is supported", code="unsupported_response_type"
        )
    params = _authorize_params(locals())
    async with kit.sessions() as session:
        await oidc_provider.validate_authorize_request(session, params)
    return HTMLResponse(oidc_provider.login_form(params, email=login_hint or ""))


@router.post("/oauth/authorize", response_class=HTMLResponse, tags=["oidc"])
async def authorize_submit(
    request: Request,
    kit: Kit,
    client_id: Annotated[str, Form(max_length=200)],
    redirect_uri: Annotated[str, Form(max_length=500)],
    email: Annotated[str, Form(max_length=320)],
    password: Annotated[str, Form(max_length=256)],
    scope: Annotated[str, Form(max_length=500)] = "openid",
    state: Annotated[str | None, Form(max_length=500)] = None,
    nonce: Annotated[str | None, Form(max_length=500)] = None,
    code_challenge: Annotated[str | None, Form(max_length=200)] = None,
    code_challenge_method: Annotated[str | None, Form(max_length=10)] = None,
) -> Any:
    """The login form's submission: on success, 303 to the client's redirect_uri with the code; on a
    failed login the form is shown again with the error inline (its stable code in `data-code`)."""
    params = _authorize_params(locals())
    try:
        url = await oidc_provider.authorize_with_password(
            kit.sessions,
            kit.settings_as(Settings),
            params=params,
            email=email,
            password=password,
            client=client_of(request, kit),
        )
    except oidc_provider.InvalidAuthorizeRequest:
        raise
    except Problem as exc:
        return HTMLResponse(oidc_provider.login_form(params, error=exc.code, email=email), status_code=exc.status)
    return RedirectResponse(url, status_code=303)


def unverified_audience(token: str) -> str | None:
    """The `aud` a token claims, read before verification only to pick the verifier that checks it."""
    try:
        payload = token.split(".")[1]
        aud = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))).get("aud")
    except (IndexError, ValueError, AttributeError):
        return None
    return aud if isinstance(aud, str) else None


@router.get("/oauth/userinfo", tags=["oidc"])
async def userinfo(request: Request, kit: Kit) -> dict[str, Any]:
    """The user's claims: all OIDC ones for a platform token, a relying party's granted ones for its
    token (audience = its client_id; the email only once verified)."""
    token = bearer_token(request)
    if not token:
        raise Unauthorized("a bearer token is required", code="missing_token")
    audience = unverified_audience(token)
    platform = kit.verifier
    if audience is None or audience == kit.settings_as(Settings).jwt_audience:
        principal = await platform.verify(token)
        client_id = None
    else:
        issuer = kit.settings_as(Settings).public_url
        principal = await TokenVerifier(platform.jwks, issuer, audience, platform.revocations).verify(token)
        client_id = audience
    async with kit.sessions() as session:
        return await oidc_provider.userinfo(session, principal, client_id=client_id)


@router.post(
    "/oauth-clients",
    response_model=OAuthClient,
    status_code=201,
    tags=["oidc"],
    **action("identity.oauth_client.manage"),
)
async def create_oauth_client(kit: Kit, body: OAuthClientCreate, principal: CurrentPrincipal) -> Any:
    """Register a relying party of this identity service (authorization code + PKCE)."""
    async with kit.sessions() as session, session.begin():
        return await oidc_provider.create_client(
            session,
            principal,
            name=body.name,
            redirect_uris=body.redirect_uris,
            confidential=body.confidential,
            tenant_id=body.tenant_id,
        )


@router.post("/keys/rotate", response_model=KeyRotation, tags=["oidc"], **action("identity.key.rotate"))
async def rotate_keys(kit: Kit, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session, session.begin():
        return await signing_keys.rotate_signing_key(session, principal)
