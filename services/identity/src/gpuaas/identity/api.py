"""Identity's HTTP surface (thin: validation here, rules in service.py / tokens.py / oidc.py / sso.py).

Routes whose authorization happens inside the use case declare their permission action in the
OpenAPI document (`x-gpuaas-action`), like the kit does for `require(action)` routes.
"""

from __future__ import annotations

import base64
import json
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal
from urllib.parse import unquote

from fastapi import APIRouter, Form, Query, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from joserfc import jws
from pydantic import BaseModel, EmailStr, Field
from sqlalchemy import func, select

from gpuaas.contracts.enums import Role
from gpuaas.identity import keys, oidc, service, sso, tokens
from gpuaas.identity.models import audit_records
from gpuaas.kit import iam
from gpuaas.kit.auth import CurrentPrincipal, Principal, bearer_token
from gpuaas.kit.errors import Forbidden, Problem, Unauthorized, Unprocessable

router = APIRouter()
SSO_LOGIN_CODE_GRANT = "sso_login_code"
SLUG = r"^[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?$"
DOMAIN = r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)+$"


def action(name: str) -> dict[str, Any]:
    iam.roles_allowed(name)  # fail at import on a typo
    return {"openapi_extra": {iam.ACTION_EXTENSION: name}}


# ---------------------------------------------------------------------------------------- schemas


class TokenResponse(BaseModel):
    access_token: str
    token_type: str
    expires_in: int
    refresh_token: str | None = None
    session_id: uuid.UUID | None = None
    id_token: str | None = None
    scope: str | None = None
    link_method: str | None = None


class TenantCreate(BaseModel):
    slug: str = Field(pattern=SLUG, description="lowercase letters, digits and dashes")
    name: str = Field(min_length=1, max_length=200)


class Tenant(BaseModel):
    tenant_id: uuid.UUID
    slug: str
    name: str
    status: str


class ProjectCreate(BaseModel):
    name: str = Field(min_length=1, max_length=100)


class Project(BaseModel):
    project_id: uuid.UUID
    tenant_id: uuid.UUID
    name: str
    archived: bool


class UserCreate(BaseModel):
    email: EmailStr
    password: str = Field(min_length=12, max_length=256)
    display_name: str = Field("", max_length=200)
    role: Role | None = Role.project_member
    email_verified: bool = Field(False, description="the admin vouches for the address (used by federation)")


class PlatformUserCreate(BaseModel):
    email: EmailStr
    password: str = Field(min_length=12, max_length=256)
    display_name: str = Field("", max_length=200)


class UserCreated(BaseModel):
    user_id: uuid.UUID
    email: str
    tenant_id: uuid.UUID | None
    membership_id: uuid.UUID | None


class User(BaseModel):
    user_id: uuid.UUID
    email: str
    display_name: str
    tenant_id: uuid.UUID | None
    status: str
    email_verified: bool
    last_login_at: datetime | None = None


class UserStatus(BaseModel):
    user_id: uuid.UUID
    email: str
    tenant_id: uuid.UUID | None
    status: str


class MemberAdd(BaseModel):
    user_id: uuid.UUID
    role: Role


class PlatformAdminAdd(BaseModel):
    user_id: uuid.UUID


class Membership(BaseModel):
    membership_id: uuid.UUID
    user_id: uuid.UUID
    scope: str
    role: Role
    tenant_id: uuid.UUID | None
    project_id: uuid.UUID | None
    email: str | None = None


class Granted(BaseModel):
    membership_id: uuid.UUID
    user_id: uuid.UUID
    role: Role
    tenant_id: uuid.UUID | None = None
    project_id: uuid.UUID | None = None


class Me(BaseModel):
    user_id: uuid.UUID
    email: str
    display_name: str
    tenant_id: uuid.UUID | None
    status: str
    email_verified: bool
    memberships: list[Membership]


class SessionInfo(BaseModel):
    session_id: uuid.UUID
    method: str
    idp_id: uuid.UUID | None
    user_agent: str | None
    client_ip: str | None
    created_at: datetime
    last_used_at: datetime
    expires_at: datetime
    revoked: bool
    revoked_reason: str | None
    current: bool


class ServiceAccountCreate(BaseModel):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    scopes: list[str] = Field(min_length=1, max_length=20)


class ServiceAccount(BaseModel):
    service_account_id: uuid.UUID
    client_id: str
    tenant_id: uuid.UUID
    project_id: uuid.UUID
    name: str
    scopes: list[str]
    disabled: bool
    created_at: datetime
    secret_rotated_at: datetime


class ServiceAccountWithSecret(ServiceAccount):
    client_secret: str = Field(description="shown once; store it now")


class IdpCreate(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    issuer: str = Field(pattern=r"^https?://", max_length=500)
    client_id: str = Field(min_length=1, max_length=300)
    client_secret: str | None = Field(None, max_length=500)
    domains: list[Annotated[str, Field(pattern=DOMAIN, max_length=253)]] = Field(min_length=1, max_length=50)
    default_role: Role | None = Role.project_member
    enforce_sso: bool = False


class Idp(BaseModel):
    idp_id: uuid.UUID
    tenant_id: uuid.UUID
    name: str
    issuer: str
    domains: list[str]
    default_role: Role | None
    enforce_sso: bool
    enabled: bool


class Discovery(BaseModel):
    email: str
    account_type: Literal["personal", "work"]
    login: Literal["password", "sso"]
    tenant: dict[str, Any] | None
    identity_provider: dict[str, Any] | None
    tenant_hint: dict[str, Any] | None


class OAuthClientCreate(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    redirect_uris: list[Annotated[str, Field(pattern=r"^https?://", max_length=500)]] = Field(min_length=1)
    confidential: bool = True


class OAuthClient(BaseModel):
    client_id: str
    client_secret: str | None
    name: str
    redirect_uris: list[str]


class KeyRotation(BaseModel):
    kid: str
    retired: list[str]


class AuditEntry(BaseModel):
    event_id: uuid.UUID
    occurred_at: datetime
    service: str
    actor_kind: str
    actor_id: str
    tenant_id: uuid.UUID | None
    project_id: uuid.UUID | None
    action: str
    resource_type: str
    resource_id: str
    outcome: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    reason: str | None
    correlation_id: str | None


class AuditPage(BaseModel):
    items: list[AuditEntry]
    total: int


# ---------------------------------------------------------------------------------------- helpers


def _kit(request: Request) -> Any:
    return request.app.state.kit


def _client(request: Request) -> tokens.Client:
    settings = _kit(request).settings
    peer = request.client.host if request.client else "unknown"
    ip = peer
    forwarded = request.headers.get("x-forwarded-for")
    if peer in settings.trusted_proxies and forwarded:
        ip = forwarded.split(",")[-1].strip() or peer
    return tokens.Client(ip=ip, user_agent=request.headers.get("user-agent"))


def _metadata(request: Request) -> sso.IdpMetadata:
    kit = _kit(request)
    if "idp_metadata" not in kit.extras:
        kit.extras["idp_metadata"] = sso.IdpMetadata(kit.settings.idp_timeout_s)
    return kit.extras["idp_metadata"]


def _basic_auth(request: Request) -> tuple[str | None, str | None]:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic" or not value:
        return None, None
    try:
        user, _, secret = base64.b64decode(value).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        raise Unauthorized("malformed basic credentials", code="invalid_client") from None
    return unquote(user), unquote(secret)


def _session_id_of(token: str) -> uuid.UUID | None:
    """The `sid` claim of an already verified token."""
    try:
        payload = json.loads(jws.extract_compact(token.encode()).payload)
        return uuid.UUID(payload["sid"]) if payload.get("sid") else None
    except (ValueError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------------------------ OIDC / auth


@router.get("/.well-known/jwks.json", tags=["oidc"])
async def jwks(request: Request, response: Response) -> dict[str, Any]:
    response.headers["Cache-Control"] = "public, max-age=60"
    settings = _kit(request).settings
    async with _kit(request).sessions() as session:
        return await keys.jwks(session, max(settings.access_token_ttl_s, settings.id_token_ttl_s))


@router.get("/.well-known/openid-configuration", tags=["oidc"])
async def discovery(request: Request) -> dict[str, Any]:
    issuer = _kit(request).settings.public_url
    return {
        "issuer": issuer,
        "authorization_endpoint": f"{issuer}/oauth/authorize",
        "token_endpoint": f"{issuer}/auth/token",
        "userinfo_endpoint": f"{issuer}/oauth/userinfo",
        "jwks_uri": f"{issuer}/.well-known/jwks.json",
        "end_session_endpoint": f"{issuer}/auth/logout",
        "grant_types_supported": [
            "authorization_code",
            "refresh_token",
            "password",
            "client_credentials",
            SSO_LOGIN_CODE_GRANT,
        ],
        "response_types_supported": ["code"],
        "response_modes_supported": ["query"],
        "code_challenge_methods_supported": ["S256"],
        "scopes_supported": ["openid", "email", "profile", *sorted(iam.SCOPE_ACTIONS)],
        "claims_supported": ["sub", "email", "email_verified", "name", "tenant_id", "project_id", "typ", "sid"],
        "id_token_signing_alg_values_supported": ["ES256"],
        "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post", "none"],
        "subject_types_supported": ["public"],
    }


@router.post("/auth/token", response_model=TokenResponse, response_model_exclude_none=True, tags=["auth"])
async def token(
    request: Request,
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
    kit = _kit(request)
    settings = kit.settings
    if grant_type == "password":
        if not username or password is None:
            raise Unprocessable("username and password are required", code="invalid_request")
        return await tokens.password_login(
            kit.sessions, settings, email=username, password=password, client=_client(request)
        )
    if grant_type == SSO_LOGIN_CODE_GRANT:
        if not code:
            raise Unprocessable("code is required", code="invalid_request")
        return await sso.exchange_login_code(
            kit.sessions, settings, code=code, code_verifier=code_verifier, client=_client(request)
        )
    if grant_type == "refresh_token":
        if not refresh_token:
            raise Unprocessable("refresh_token is required", code="invalid_request")
        return await tokens.refresh(kit.sessions, settings, refresh_token=refresh_token)
    basic_id, basic_secret = _basic_auth(request)
    client_id, client_secret = basic_id or client_id, basic_secret or client_secret
    if grant_type == "client_credentials":
        if not client_id or not client_secret:
            raise Unauthorized("client_id and client_secret are required", code="invalid_client")
        return await tokens.client_credentials(
            kit.sessions,
            settings,
            client_id=client_id,
            client_secret=client_secret,
            scope=scope,
            client=_client(request),
        )
    if grant_type == "authorization_code":
        if not code:
            raise Unprocessable("code is required", code="invalid_request")
        return await oidc.exchange_code(
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
async def logout(request: Request, refresh_token: Annotated[str | None, Form(max_length=200)] = None) -> Response:
    """End the session of the presented access token (Authorization header) or refresh token."""
    principal: Principal | None = None
    session_id = None
    if raw := bearer_token(request):
        principal = await _kit(request).verifier.verify(raw)
        session_id = _session_id_of(raw)
    await tokens.logout(_kit(request).sessions, principal=principal, session_id=session_id, refresh_token=refresh_token)
    return Response(status_code=204)


@router.get("/auth/discover", response_model=Discovery, tags=["auth"])
async def discover(
    request: Request,
    email: Annotated[EmailStr, Query()],
    tenant: Annotated[str | None, Query(max_length=40, description="advisory tenant slug hint")] = None,
) -> Any:
    """Account-type discovery: personal vs work account, and which tenant and identity provider."""
    async with _kit(request).sessions() as session:
        return await sso.discover(session, _kit(request).settings, email=str(email), tenant_hint=tenant)


@router.get("/auth/sso/start", tags=["auth"], status_code=302, response_class=RedirectResponse)
async def sso_start(
    request: Request,
    idp_id: uuid.UUID | None = None,
    email: Annotated[EmailStr | None, Query()] = None,
    return_to: Annotated[
        str | None,
        Query(
            max_length=2000,
            description="where the browser goes back with a single-use `login_code` (or `error`): a console "
            "page of this platform or the CLI's loopback `http://127.0.0.1:<port>/...`; else 400 invalid_return_to",
        ),
    ] = None,
    code_challenge: Annotated[
        str | None,
        Query(
            max_length=128,
            description="required with return_to (else 400 code_challenge_required): the base64url SHA-256 of "
            "a random `code_verifier` (RFC 7636 S256) that the client keeps and sends with the login code to "
            "`POST /auth/token`, so only the client that started the login can redeem it",
        ),
    ] = None,
    code_challenge_method: Annotated[
        str | None, Query(max_length=10, description="`S256`, the only method (else 400 invalid_code_challenge)")
    ] = None,
) -> Any:
    """Begin an enterprise SSO login (authorization code + PKCE): redirects to the tenant's IdP."""
    url = await sso.start(
        _kit(request).sessions,
        _kit(request).settings,
        _metadata(request),
        idp_id=idp_id,
        email=str(email) if email else None,
        return_to=return_to,
        code_challenge=code_challenge,
        code_challenge_method=code_challenge_method,
    )
    return RedirectResponse(url, status_code=302)


@router.get(
    "/auth/sso/callback",
    response_model=TokenResponse,
    response_model_exclude_none=True,
    tags=["auth"],
    responses={302: {"description": "back to the return_to with `login_code`, or `error` + `error_description`"}},
)
async def sso_callback(
    request: Request,
    state: Annotated[str, Query(max_length=200)],
    code: Annotated[str | None, Query(max_length=500)] = None,
    error: Annotated[str | None, Query(max_length=200)] = None,
) -> Any:
    """The IdP redirects here; the user is linked or provisioned (brokered linking) and signed in: the
    token pair as JSON, or (when the login started with a `return_to`) a 302 back there with a
    single-use `login_code` for `POST /auth/token` (grant_type=sso_login_code), or `error` +
    `error_description`."""
    outcome = await sso.callback(
        _kit(request).sessions,
        _kit(request).settings,
        _metadata(request),
        state=state,
        code=code,
        error=error,
        client=_client(request),
    )
    if isinstance(outcome, sso.Redirect):
        return RedirectResponse(outcome.url, status_code=302, headers={"Cache-Control": "no-store"})
    return outcome


def _authorize_params(values: dict[str, Any]) -> dict[str, str | None]:
    return {k: (str(values[k]) if values.get(k) is not None else None) for k in oidc.AUTHORIZE_PARAMS}


@router.get("/oauth/authorize", response_class=HTMLResponse, tags=["oidc"])
async def authorize_form(
    request: Request,
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
        raise oidc.InvalidAuthorizeRequest("only response_type=code is supported", code="unsupported_response_type")
    params = _authorize_params(locals())
    async with _kit(request).sessions() as session:
        await oidc.validate_authorize_request(session, params)
    return HTMLResponse(oidc.login_form(params, email=login_hint or ""))


@router.post("/oauth/authorize", response_class=HTMLResponse, tags=["oidc"])
async def authorize_submit(
    request: Request,
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
    kit = _kit(request)
    try:
        url = await oidc.authorize_with_password(
            kit.sessions, kit.settings, params=params, email=email, password=password, client=_client(request)
        )
    except oidc.InvalidAuthorizeRequest:
        raise
    except Problem as exc:
        return HTMLResponse(oidc.login_form(params, error=exc.code, email=email), status_code=exc.status)
    return RedirectResponse(url, status_code=303)


@router.get("/oauth/userinfo", tags=["oidc"])
async def userinfo(request: Request, principal: CurrentPrincipal) -> dict[str, Any]:
    async with _kit(request).sessions() as session:
        return await oidc.userinfo(session, principal)


# ------------------------------------------------------------------------------------ self service


@router.get("/me", response_model=Me, tags=["users"])
async def me(request: Request, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session:
        return await service.me(session, principal)


@router.get("/sessions", response_model=list[SessionInfo], tags=["sessions"])
async def list_sessions(request: Request, principal: CurrentPrincipal) -> Any:
    """Your own sessions (newest first); `current` marks the one this token belongs to."""
    raw = bearer_token(request) or ""
    async with _kit(request).sessions() as session:
        return await tokens.list_sessions(session, principal, current=_session_id_of(raw))


@router.delete("/sessions/{session_id}", status_code=204, tags=["sessions"])
async def revoke_session(request: Request, session_id: uuid.UUID, principal: CurrentPrincipal) -> Response:
    async with _kit(request).sessions() as session, session.begin():
        await tokens.revoke_own_session(session, principal, session_id)
    return Response(status_code=204)


# --------------------------------------------------------------------------- tenants and projects


@router.post("/tenants", response_model=Tenant, status_code=201, tags=["tenants"], **action("identity.tenant.create"))
async def create_tenant(request: Request, body: TenantCreate, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return {**await service.create_tenant(session, principal, slug=body.slug, name=body.name), "status": "active"}


@router.get("/tenants", response_model=list[Tenant], tags=["tenants"])
async def list_tenants(request: Request, principal: CurrentPrincipal) -> Any:
    """Operators: every tenant; everyone else: the tenants they are a member of."""
    async with _kit(request).sessions() as session:
        return await service.list_tenants(session, principal)


@router.get("/tenants/{tenant_id}", response_model=Tenant, tags=["tenants"], **action("identity.tenant.read"))
async def get_tenant(request: Request, tenant_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session:
        return await service.get_tenant(session, principal, tenant_id)


@router.post(
    "/tenants/{tenant_id}/projects",
    response_model=Project,
    status_code=201,
    tags=["projects"],
    **action("identity.project.create"),
)
async def create_project(
    request: Request, tenant_id: uuid.UUID, body: ProjectCreate, principal: CurrentPrincipal
) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.create_project(session, principal, tenant_id=tenant_id, name=body.name)


@router.get("/tenants/{tenant_id}/projects", response_model=list[Project], tags=["projects"])
async def list_projects(request: Request, tenant_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    """Tenant admins and operators see every project of the tenant; other members their own."""
    async with _kit(request).sessions() as session:
        return await service.list_projects(session, principal, tenant_id)


@router.get("/projects/{project_id}", response_model=Project, tags=["projects"], **action("identity.project.read"))
async def get_project(request: Request, project_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session:
        return await service.get_project(session, principal, project_id)


# ---------------------------------------------------------------------------------- users, members


@router.post(
    "/tenants/{tenant_id}/users",
    response_model=UserCreated,
    status_code=201,
    tags=["users"],
    **action("identity.member.manage"),
)
async def create_user(request: Request, tenant_id: uuid.UUID, body: UserCreate, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.create_tenant_user(
            session,
            principal,
            tenant_id=tenant_id,
            email=body.email,
            password=body.password,
            display_name=body.display_name,
            role=body.role,
            email_verified=body.email_verified,
        )


@router.get("/tenants/{tenant_id}/users", response_model=list[User], tags=["users"], **action("identity.user.read"))
async def list_users(request: Request, tenant_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session:
        return await service.list_tenant_users(session, principal, tenant_id)


@router.post(
    "/tenants/{tenant_id}/members",
    response_model=Granted,
    status_code=201,
    tags=["users"],
    **action("identity.member.manage"),
)
async def add_tenant_member(
    request: Request, tenant_id: uuid.UUID, body: MemberAdd, principal: CurrentPrincipal
) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.add_tenant_member(
            session, principal, tenant_id=tenant_id, user_id=body.user_id, role=body.role
        )


@router.post(
    "/users", response_model=UserCreated, status_code=201, tags=["users"], **action("identity.platform_admin.manage")
)
async def create_platform_user(request: Request, body: PlatformUserCreate, principal: CurrentPrincipal) -> Any:
    """A platform account with no tenant (operators-to-be)."""
    async with _kit(request).sessions() as session, session.begin():
        return await service.create_platform_user(
            session, principal, email=body.email, password=body.password, display_name=body.display_name
        )


@router.post("/users/{user_id}/disable", response_model=UserStatus, tags=["users"], **action("identity.user.manage"))
async def disable_user(request: Request, user_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    """Disable an account: its sessions are revoked and every service denies it once the event lands."""
    async with _kit(request).sessions() as session, session.begin():
        return await service.set_user_status(session, principal, user_id, "disabled")


@router.post("/users/{user_id}/enable", response_model=UserStatus, tags=["users"], **action("identity.user.manage"))
async def enable_user(request: Request, user_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.set_user_status(session, principal, user_id, "active")


@router.post(
    "/platform-admins",
    response_model=Granted,
    status_code=201,
    tags=["users"],
    **action("identity.platform_admin.manage"),
)
async def add_platform_admin(request: Request, body: PlatformAdminAdd, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.grant_platform_admin(session, principal, user_id=body.user_id)


@router.post(
    "/projects/{project_id}/members",
    response_model=Granted,
    status_code=201,
    tags=["projects"],
    **action("identity.member.manage"),
)
async def add_member(request: Request, project_id: uuid.UUID, body: MemberAdd, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.add_project_member(
            session, principal, project_id=project_id, user_id=body.user_id, role=body.role
        )


@router.get(
    "/projects/{project_id}/members",
    response_model=list[Membership],
    tags=["projects"],
    **action("identity.member.read"),
)
async def list_members(request: Request, project_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session:
        return await service.list_project_members(session, principal, project_id)


@router.delete("/memberships/{membership_id}", status_code=204, tags=["projects"], **action("identity.member.manage"))
async def revoke_membership(request: Request, membership_id: uuid.UUID, principal: CurrentPrincipal) -> Response:
    """Revoke a membership; every service denies the access as soon as it applies the event."""
    async with _kit(request).sessions() as session, session.begin():
        await service.revoke_membership(session, principal, membership_id)
    return Response(status_code=204)


# -------------------------------------------------------------------------------- service accounts


@router.post(
    "/projects/{project_id}/service-accounts",
    response_model=ServiceAccountWithSecret,
    status_code=201,
    tags=["service accounts"],
    **action("identity.service_account.manage"),
)
async def create_service_account(
    request: Request, project_id: uuid.UUID, body: ServiceAccountCreate, principal: CurrentPrincipal
) -> Any:
    """A project service account (OAuth client for `client_credentials`); the secret is shown once."""
    async with _kit(request).sessions() as session, session.begin():
        return await service.create_service_account(
            session, principal, project_id=project_id, name=body.name, scopes=body.scopes
        )


@router.get(
    "/projects/{project_id}/service-accounts",
    response_model=list[ServiceAccount],
    tags=["service accounts"],
    **action("identity.service_account.read"),
)
async def list_service_accounts(request: Request, project_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session:
        return await service.list_service_accounts(session, principal, project_id)


@router.post(
    "/service-accounts/{service_account_id}/rotate-secret",
    response_model=ServiceAccountWithSecret,
    tags=["service accounts"],
    **action("identity.service_account.manage"),
)
async def rotate_secret(request: Request, service_account_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.rotate_service_account_secret(session, principal, service_account_id)


@router.post(
    "/service-accounts/{service_account_id}/disable",
    response_model=ServiceAccount,
    tags=["service accounts"],
    **action("identity.service_account.manage"),
)
async def disable_service_account(request: Request, service_account_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.set_service_account_disabled(session, principal, service_account_id, True)


@router.post(
    "/service-accounts/{service_account_id}/enable",
    response_model=ServiceAccount,
    tags=["service accounts"],
    **action("identity.service_account.manage"),
)
async def enable_service_account(request: Request, service_account_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.set_service_account_disabled(session, principal, service_account_id, False)


# ------------------------------------------------------------------------------------ federation


@router.post(
    "/tenants/{tenant_id}/identity-providers",
    response_model=Idp,
    status_code=201,
    tags=["federation"],
    **action("identity.idp.manage"),
)
async def create_idp(request: Request, tenant_id: uuid.UUID, body: IdpCreate, principal: CurrentPrincipal) -> Any:
    """Register the tenant's enterprise OIDC IdP and the email domains the tenant owns through it."""
    async with _kit(request).sessions() as session, session.begin():
        return await sso.create_idp(
            session,
            principal,
            tenant_id=tenant_id,
            name=body.name,
            issuer=body.issuer,
            client_id=body.client_id,
            client_secret=body.client_secret,
            domains=body.domains,
            default_role=body.default_role,
            enforce_sso=body.enforce_sso,
        )


@router.get(
    "/tenants/{tenant_id}/identity-providers",
    response_model=list[Idp],
    tags=["federation"],
    **action("identity.idp.manage"),
)
async def list_idps(request: Request, tenant_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session:
        return await sso.list_idps(session, principal, tenant_id)


@router.post(
    "/oauth-clients",
    response_model=OAuthClient,
    status_code=201,
    tags=["oidc"],
    **action("identity.oauth_client.manage"),
)
async def create_oauth_client(request: Request, body: OAuthClientCreate, principal: CurrentPrincipal) -> Any:
    """Register a relying party of this identity service (authorization code + PKCE)."""
    async with _kit(request).sessions() as session, session.begin():
        return await oidc.create_client(
            session, principal, name=body.name, redirect_uris=body.redirect_uris, confidential=body.confidential
        )


@router.post("/keys/rotate", response_model=KeyRotation, tags=["oidc"], **action("identity.key.rotate"))
async def rotate_keys(request: Request, principal: CurrentPrincipal) -> Any:
    async with _kit(request).sessions() as session, session.begin():
        return await service.rotate_signing_key(session, principal)


# ------------------------------------------------------------------------------------------ audit


@router.get("/audit", response_model=AuditPage, tags=["audit"], **action("identity.audit.read"))
async def list_audit(
    request: Request,
    principal: CurrentPrincipal,
    tenant_id: uuid.UUID | None = None,
    project_id: uuid.UUID | None = None,
    actor_id: str | None = Query(None, max_length=200),
    resource_type: str | None = Query(None, max_length=100),
    resource_id: str | None = Query(None, max_length=200),
    action: str | None = Query(None, max_length=100),
    service_name: str | None = Query(None, alias="service", max_length=50),
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0),
) -> Any:
    """Operators see every record; tenant admins their tenant's (pass `tenant_id`). Newest first."""
    for name, value in (("since", since), ("until", until)):
        if value is not None and value.tzinfo is None:
            raise Unprocessable(f"{name} needs a UTC offset", code="naive_datetime")
    async with _kit(request).sessions() as session:
        if not await iam.is_platform_admin(session, principal):
            if tenant_id is None:
                raise Forbidden("pass the tenant_id whose audit trail you administer", code="tenant_required")
            await iam.authorize(session, principal, "identity.audit.read", tenant_id=tenant_id)
        c = audit_records.c
        where = []
        for column, value in (
            (c.tenant_id, tenant_id),
            (c.project_id, project_id),
            (c.actor_id, actor_id),
            (c.resource_type, resource_type),
            (c.resource_id, resource_id),
            (c.action, action),
            (c.service, service_name),
        ):
            if value is not None:
                where.append(column == value)
        if since is not None:
            where.append(c.occurred_at >= since)
        if until is not None:
            where.append(c.occurred_at < until)
        rows = await session.execute(
            select(audit_records).where(*where).order_by(c.occurred_at.desc(), c.seq.desc()).limit(limit).offset(offset)
        )
        total = (await session.execute(select(func.count()).select_from(audit_records).where(*where))).scalar_one()
    return {"items": [dict(r._mapping) for r in rows], "total": total}
