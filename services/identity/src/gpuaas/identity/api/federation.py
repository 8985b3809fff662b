"""Federation: account-type discovery, enterprise SSO login (start and the IdP's callback), and the
registration of tenants' identity providers."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import RedirectResponse
from pydantic import EmailStr

from gpuaas.identity.api.deps import action, client_of
from gpuaas.identity.api.schemas import Discovery, DomainClaim, Idp, IdpCreate, TokenResponse
from gpuaas.identity.domain import Redirect
from gpuaas.identity.runtime import IdentityRuntime
from gpuaas.identity.service import federation, sso
from gpuaas.identity.settings import Settings
from gpuaas.kit.app import Kit
from gpuaas.kit.auth import CurrentPrincipal

router = APIRouter()


@router.get("/auth/discover", response_model=Discovery, tags=["auth"])
async def discover(
    kit: Kit,
    email: Annotated[EmailStr, Query()],
    tenant: Annotated[str | None, Query(max_length=40, description="advisory tenant slug hint")] = None,
) -> Any:
    """Account-type discovery: personal vs work account, and which tenant and identity provider."""
    async with kit.sessions() as session:
        found = await federation.discover(session, kit.settings_as(Settings), email=str(email), tenant_hint=tenant)
    return found.model_dump()  # Discovery answers its parts as plain objects


@router.get("/auth/sso/start", tags=["auth"], status_code=302, response_class=RedirectResponse)
async def sso_start(
    kit: Kit,
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
        kit.sessions,
        kit.settings_as(Settings),
        kit.state_as(IdentityRuntime).idp_metadata,
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
    kit: Kit,
    state: Annotated[str, Query(max_length=200)],
    code: Annotated[str | None, Query(max_length=500)] = None,
    error: Annotated[str | None, Query(max_length=200)] = None,
) -> Any:
    """The IdP redirects here; the user is linked or provisioned (brokered linking) and signed in: the
    token pair as JSON, or (when the login started with a `return_to`) a 302 back there with a
    single-use `login_code` for `POST /auth/token` (grant_type=sso_login_code), or `error` +
    `error_description`."""
    outcome = await sso.callback(
        kit.sessions,
        kit.settings_as(Settings),
        kit.state_as(IdentityRuntime).idp_metadata,
        state=state,
        code=code,
        error=error,
        client=client_of(request, kit),
    )
    if isinstance(outcome, Redirect):
        return RedirectResponse(outcome.url, status_code=302, headers={"Cache-Control": "no-store"})
    return outcome


@router.post(
    "/tenants/{tenant_id}/identity-providers",
    response_model=Idp,
    status_code=201,
    tags=["federation"],
    **action("identity.idp.manage"),
)
async def create_idp(kit: Kit, tenant_id: uuid.UUID, body: IdpCreate, principal: CurrentPrincipal) -> Any:
    """Register the tenant's enterprise OIDC IdP and the email domains the tenant owns through it."""
    async with kit.sessions() as session, session.begin():
        return await federation.create_idp(
            session,
            principal,
            kit.settings_as(Settings),
            tenant_id=tenant_id,
            name=body.name,
            issuer=body.issuer,
            client_id=body.client_id,
            client_secret=body.client_secret,
            domains=body.domains,
            default_role=body.default_role,
            enforce_sso=body.enforce_sso,
            domains_verified=body.domains_verified,
        )


@router.post(
    "/tenants/{tenant_id}/identity-providers/{idp_id}/domains/{domain}/verify",
    response_model=DomainClaim,
    tags=["federation"],
    responses={409: {"description": "`domain_not_proven` (no TXT record yet) or `domain_taken`"}},
    **action("identity.idp.manage"),
)
async def verify_domain(
    kit: Kit,
    tenant_id: uuid.UUID,
    idp_id: uuid.UUID,
    domain: Annotated[str, Path(max_length=253)],
    principal: CurrentPrincipal,
) -> Any:
    """Prove a domain claim: identity looks up the claim's TXT record (`challenge_name` =
    `challenge_value`) through the operator's DNS resolver. Until proven, the domain serves no
    discovery, linking or enforced SSO."""
    return await federation.verify_domain(
        kit.sessions,
        principal,
        kit.state_as(IdentityRuntime).resolver,
        tenant_id=tenant_id,
        idp_id=idp_id,
        domain=domain,
    )


@router.get(
    "/tenants/{tenant_id}/identity-providers",
    response_model=list[Idp],
    tags=["federation"],
    **action("identity.idp.manage"),
)
async def list_idps(kit: Kit, tenant_id: uuid.UUID, principal: CurrentPrincipal) -> Any:
    async with kit.sessions() as session:
        return await federation.list_idps(session, principal, tenant_id)
