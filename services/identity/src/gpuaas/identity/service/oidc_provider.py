"""Identity as an OpenID Connect provider: registered clients, the authorization endpoint (code flow
with PKCE S256 only), the authorization-code grant with an ID token, userinfo, and the provider's
discovery document.

This is what lets one identity instance act as a tenant's enterprise IdP for another (the SSO test),
and what the web console can use instead of the password grant.

What a relying party gets is limited: only the OIDC scopes (openid, email, profile) can be granted;
the access token's audience is the client itself (so no platform service accepts it: it opens
userinfo only); a client registered for a tenant serves only that tenant's users; and the `email`
claim is passed on only when identity verified the address (never on a tenant admin's word).
PKCE and client-credential checks use authlib's RFC 7636 helpers; tokens are signed with the same
ES256 keys as access tokens.
"""

from __future__ import annotations

import hmac
import html
import time
import uuid
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

from authlib.oauth2.rfc7636 import create_s256_code_challenge
from sqlalchemy import Row, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.identity import SERVICE, keys
from gpuaas.identity.credentials import Client, new_secret, now, token_hash
from gpuaas.identity.models import authorization_codes, oauth_clients, users
from gpuaas.identity.service import views
from gpuaas.identity.service.logins import authenticate_password
from gpuaas.identity.settings import Settings
from gpuaas.kit import audit, iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Problem, Unauthorized

# The scopes a relying party may be granted: identity facts, never the platform's API.
OIDC_SCOPES = frozenset({"openid", "email", "profile"})
AUTHORIZE_PARAMS = ("client_id", "redirect_uri", "scope", "state", "nonce", "code_challenge", "code_challenge_method")
# Identity's own grant for the single-use code a finished SSO login hands to its return_to.
SSO_LOGIN_CODE_GRANT = "sso_login_code"


def discovery_document(issuer: str) -> dict[str, Any]:
    """The OpenID Provider Metadata (OIDC Discovery 1.0): a standard JSON document, answered as is."""
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


async def jwks(session: AsyncSession, settings: Settings) -> dict[str, Any]:
    """The public signing keys (a JWK Set document), retired ones included while their tokens live."""
    return await keys.jwks(session, max(settings.access_token_ttl_s, settings.id_token_ttl_s))


class InvalidAuthorizeRequest(Problem):
    """A broken authorization request is answered here, never redirected to an unverified URI."""

    status, code, title = 400, "invalid_request", "Invalid authorization request"


async def create_client(
    session: AsyncSession,
    principal: Principal,
    *,
    name: str,
    redirect_uris: list[str],
    confidential: bool,
    tenant_id: uuid.UUID | None = None,
) -> views.OAuthClient:
    await iam.authorize(session, principal, "identity.oauth_client.manage")
    client_id = f"client_{uuid.uuid4().hex[:20]}"
    secret = new_secret("cs") if confidential else None
    await session.execute(
        insert(oauth_clients).values(
            client_id=client_id,
            name=name,
            secret_hash=token_hash(secret) if secret else None,
            redirect_uris=redirect_uris,
            tenant_id=tenant_id,
        )
    )
    await audit.record(
        session,
        service=SERVICE,
        actor=principal,
        action="identity.oauth_client.create",
        resource_type="oauth_client",
        resource_id=client_id,
        after={
            "name": name,
            "redirect_uris": redirect_uris,
            "confidential": confidential,
            "tenant_id": str(tenant_id) if tenant_id else None,
        },
    )
    return views.OAuthClient(
        client_id=client_id, client_secret=secret, name=name, redirect_uris=redirect_uris, tenant_id=tenant_id
    )


async def validate_authorize_request(session: AsyncSession, params: dict[str, str | None]) -> Row:
    client = (
        await session.execute(select(oauth_clients).where(oauth_clients.c.client_id == (params.get("client_id") or "")))
    ).first()
    if client is None:
        raise InvalidAuthorizeRequest("unknown client_id", code="invalid_client")
    if params.get("redirect_uri") not in client.redirect_uris:
        raise InvalidAuthorizeRequest("redirect_uri is not registered for this client", code="invalid_redirect_uri")
    scopes = set((params.get("scope") or "").split())
    if "openid" not in scopes:
        raise InvalidAuthorizeRequest("scope must include openid", code="invalid_scope")
    if scopes - OIDC_SCOPES:
        raise InvalidAuthorizeRequest(
            f"only {', '.join(sorted(OIDC_SCOPES))} can be granted to a relying party", code="invalid_scope"
        )
    if params.get("code_challenge_method") != "S256" or not params.get("code_challenge"):
        raise InvalidAuthorizeRequest("PKCE with code_challenge_method=S256 is required", code="pkce_required")
    return client


def login_form(params: dict[str, str | None], error: str | None = None, email: str = "") -> str:
    hidden = "".join(
        f'<input type="hidden" name="{k}" value="{html.escape(params.get(k) or "")}">' for k in AUTHORIZE_PARAMS
    )
    err = f'<p class="error" data-code="{html.escape(error)}">{html.escape(error)}</p>' if error else ""
    return (
        "<!doctype html><html><head><meta charset=utf-8><title>Sign in</title>"
        # no favicon request (a 404 in the browser console of every sign-in)
        '<link rel="icon" href="data:,"></head><body>'
        f'<h1>Sign in</h1>{err}<form method="post">{hidden}'
        f'<label>Email <input name="email" type="email" value="{html.escape(email)}" autocomplete="username"></label>'
        '<label>Password <input name="password" type="password" autocomplete="current-password"></label>'
        '<button type="submit">Sign in</button></form></body></html>'
    )


async def authorize_with_password(
    sessions_: async_sessionmaker[AsyncSession],
    settings: Settings,
    *,
    params: dict[str, str | None],
    email: str,
    password: str,
    client: Client,
) -> str:
    """Authenticate the user at the authorization endpoint; return the redirect URL carrying the code."""
    async with sessions_() as session:
        relying_party = await validate_authorize_request(session, params)
    user = await authenticate_password(sessions_, settings, email=email, password=password, client=client)
    if relying_party.tenant_id is not None and user.tenant_id != relying_party.tenant_id:
        raise Problem(
            "this account does not belong to the application's organisation", code="access_denied", status=403
        )
    code = new_secret("ac")
    async with sessions_() as session, session.begin():
        await session.execute(
            insert(authorization_codes).values(
                code_hash=token_hash(code),
                client_id=params["client_id"],
                user_id=user.user_id,
                redirect_uri=params["redirect_uri"],
                code_challenge=params["code_challenge"],
                nonce=params.get("nonce"),
                scope=params.get("scope") or "openid",
                expires_at=now() + timedelta(seconds=settings.authorization_code_ttl_s),
            )
        )
    query = {"code": code, **({"state": params["state"]} if params.get("state") else {})}
    sep = "&" if "?" in (params["redirect_uri"] or "") else "?"
    return f"{params['redirect_uri']}{sep}{urlencode(query)}"


async def exchange_code(
    sessions_: async_sessionmaker[AsyncSession],
    settings: Settings,
    *,
    code: str,
    redirect_uri: str | None,
    code_verifier: str | None,
    client_id: str | None,
    client_secret: str | None,
) -> views.TokenResponse:
    async with sessions_() as session, session.begin():
        row = (
            await session.execute(
                select(
                    authorization_codes, oauth_clients.c.secret_hash, oauth_clients.c.tenant_id.label("client_tenant")
                )
                .join(oauth_clients, oauth_clients.c.client_id == authorization_codes.c.client_id)
                .where(authorization_codes.c.code_hash == token_hash(code))
                .with_for_update(of=authorization_codes)
            )
        ).first()
        if row is None or row.used_at is not None or row.expires_at <= now():
            raise Problem("the authorization code is unknown, used or expired", code="invalid_grant")
        if row.client_id != client_id:
            raise Unauthorized("the code was issued to another client", code="invalid_client")
        if row.secret_hash is not None and not hmac.compare_digest(row.secret_hash, token_hash(client_secret or "")):
            raise Unauthorized("wrong client secret", code="invalid_client")
        if redirect_uri != row.redirect_uri:
            raise Problem("redirect_uri differs from the authorization request", code="invalid_grant")
        if not code_verifier or not hmac.compare_digest(create_s256_code_challenge(code_verifier), row.code_challenge):
            raise Problem("the PKCE code_verifier does not match", code="invalid_grant")
        await session.execute(
            update(authorization_codes)
            .where(authorization_codes.c.code_hash == row.code_hash)
            .values(used_at=func.now())
        )
        user = (await session.execute(select(users).where(users.c.user_id == row.user_id))).one()
        if user.status != "active" or (row.client_tenant is not None and user.tenant_id != row.client_tenant):
            raise Problem("the account may not use this application", code="invalid_grant")
        granted = sorted(set(row.scope.split()) & OIDC_SCOPES)
        t = int(time.time())
        id_claims = {
            "iss": settings.public_url,
            "sub": str(user.user_id),
            "aud": row.client_id,
            "iat": t,
            "exp": t + settings.id_token_ttl_s,
            "auth_time": t,
            **identity_claims(user, granted),
        }
        if row.nonce:
            id_claims["nonce"] = row.nonce
        # For the client only (aud = client_id): no platform service accepts it, userinfo does.
        access = keys.access_claims(
            issuer=settings.public_url,
            subject=user.user_id,
            kind="user",
            ttl_s=settings.access_token_ttl_s,
            scopes=granted,
        )
        access["aud"] = row.client_id
        access["azp"] = row.client_id
        id_token = await keys.sign(session, id_claims)
        access_token = await keys.sign(session, access)
    return views.TokenResponse(
        access_token=access_token,
        id_token=id_token,
        token_type="Bearer",
        expires_in=settings.access_token_ttl_s,
        scope=" ".join(granted),
    )


def identity_claims(user: Row, scopes: list[str] | set[str] | frozenset[str]) -> dict[str, Any]:
    """The user's claims a relying party may see under `scopes`: the email only once verified."""
    claims: dict[str, Any] = {}
    if "email" in scopes and user.email_verified:
        claims["email"], claims["email_verified"] = user.email, True
    if "profile" in scopes:
        claims["name"] = user.display_name
    return claims


async def userinfo(session: AsyncSession, principal: Principal, *, client_id: str | None = None) -> dict[str, Any]:
    """Userinfo for a platform token (all OIDC scopes) or a relying party's token (its own scopes)."""
    user = (await session.execute(select(users).where(users.c.user_id == principal.subject))).first()
    if user is None or user.status != "active":
        raise Unauthorized("unknown user", code="invalid_token")
    if client_id is not None:
        known = (
            await session.execute(select(oauth_clients.c.client_id).where(oauth_clients.c.client_id == client_id))
        ).first()
        if known is None:
            raise Unauthorized("unknown client", code="invalid_token")
    scopes = OIDC_SCOPES if client_id is None else principal.scopes
    return {"sub": str(user.user_id), **identity_claims(user, scopes)}
