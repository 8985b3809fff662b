"""Enterprise SSO login (identity as the relying party of a tenant's IdP): authorization code + PKCE
against the IdP, and brokered identity linking.

Linking rules (ARCHITECTURE §5): a federated login resolves, in order,
1. an existing link (idp, subject) -> that user;
2. otherwise the IdP must vouch for the email (`email_verified`) and the email's domain must be one
   the IdP's tenant has proven it owns (DNS challenge, service/federation.py); then an existing user
   with that email is linked only if the user belongs to the same tenant (never across tenants,
   never a personal account); with no such user, one is provisioned just in time with the IdP's
   default role.
A new user is never created when one with the email exists, so no duplicates. Every link is
recorded (table, `federated_identity.linked` event, audit record); refusals are audited too.

A login started with `return_to` ends with a single-use login code in a URL; the code is bound to the
client that started the login by that client's own PKCE S256 challenge (required with `return_to`),
and only its verifier redeems it (a wrong or missing one spends the code).

Network calls to the IdP (gpuaas.identity.idp) happen between transactions, never in one.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any, Literal
from urllib.parse import urlencode

from authlib.common.security import generate_token
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from sqlalchemy import Row, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.contracts import Actor
from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.events import identity as identity_events
from gpuaas.identity import SERVICE, idp, keys
from gpuaas.identity.credentials import Client, new_secret, now, token_hash
from gpuaas.identity.domain import (
    Redirect,
    email_domain,
    validate_client_challenge,
    validate_return_to,
    verifier_matches,
    with_query,
)
from gpuaas.identity.models import (
    federated_identities,
    identity_providers,
    idp_domains,
    sso_login_codes,
    sso_states,
    users,
)
from gpuaas.identity.service import views
from gpuaas.identity.service.common import record_change
from gpuaas.identity.service.federation import idp_for_domain
from gpuaas.identity.service.sessions import open_session
from gpuaas.identity.service.users import grant, insert_user
from gpuaas.identity.settings import Settings
from gpuaas.kit import audit
from gpuaas.kit.errors import Forbidden, NotFound, Problem, Unprocessable

SSO_ACTOR = Actor.system("identity-sso")


class StateInvalid(Problem):
    status, code, title = 400, "sso_state_invalid", "Invalid sign-in state"


async def start(
    sessions_: async_sessionmaker[AsyncSession],
    settings: Settings,
    metadata: idp.IdpMetadata,
    *,
    idp_id: uuid.UUID | None,
    email: str | None,
    return_to: str | None = None,
    code_challenge: str | None = None,
    code_challenge_method: str | None = None,
) -> str:
    """Create a single-use state with a PKCE verifier and nonce (and the validated `return_to` with the
    client's own S256 challenge); return the IdP authorization URL."""
    if return_to is not None:
        return_to = validate_return_to(settings, return_to)
    client_challenge = validate_client_challenge(return_to, code_challenge, code_challenge_method)
    async with sessions_() as session:
        if idp_id is not None:
            provider = (
                await session.execute(
                    select(identity_providers).where(
                        identity_providers.c.idp_id == idp_id, identity_providers.c.enabled.is_(True)
                    )
                )
            ).first()
        elif email and "@" in email:
            provider = await idp_for_domain(session, email_domain(email))
        else:
            raise Unprocessable("pass idp_id or a work email", code="idp_required")
    if provider is None:
        raise NotFound("no identity provider for this request", code="idp_not_found")
    doc = await metadata.document(provider.issuer)
    state, verifier, nonce = generate_token(32), generate_token(64), generate_token(24)
    redirect_uri = f"{settings.public_url}/auth/sso/callback"
    async with sessions_() as session, session.begin():
        await session.execute(
            insert(sso_states).values(
                state=state,
                idp_id=provider.idp_id,
                code_verifier=verifier,
                nonce=nonce,
                redirect_uri=redirect_uri,
                expires_at=now() + timedelta(seconds=settings.sso_state_ttl_s),
                return_to=return_to,
                client_code_challenge=client_challenge,
            )
        )
    query = {
        "response_type": "code",
        "client_id": provider.client_id,
        "redirect_uri": redirect_uri,
        "scope": "openid email profile",
        "state": state,
        "nonce": nonce,
        "code_challenge": create_s256_code_challenge(verifier),
        "code_challenge_method": "S256",
    }
    if email:
        query["login_hint"] = email
    return f"{doc['authorization_endpoint']}?{urlencode(query)}"


async def callback(
    sessions_: async_sessionmaker[AsyncSession],
    settings: Settings,
    metadata: idp.IdpMetadata,
    *,
    state: str,
    code: str | None,
    error: str | None,
    client: Client,
) -> views.TokenResponse | Redirect:
    """Finish the login. Without a `return_to` the answer is the token pair (JSON). With one, the
    browser is sent back there with `login_code` (single use, short-lived; exchanged at
    `POST /auth/token`, grant_type=sso_login_code), or with `error` (a stable code) and
    `error_description` when the sign-in failed."""
    return_to: str | None = None
    try:
        async with sessions_() as session, session.begin():
            row, fresh = await _consume_state(session, state)
        return_to = row.return_to
        if not fresh:
            raise StateInvalid("the sign-in request was already used or has expired; start again")
        if error or not code:
            raise Problem(
                f"the identity provider refused the sign-in: {error or 'no code'}", code="idp_denied", status=401
            )
        user, method = await _sign_in(sessions_, settings, metadata, row, code)
        if return_to is None:
            async with sessions_() as session, session.begin():
                return await open_session(
                    session, settings, user=user, method="sso", client=client, idp_id=row.idp_id, link_method=method
                )
        login_code = new_secret("slc")
        async with sessions_() as session, session.begin():
            await session.execute(
                insert(sso_login_codes).values(
                    code_hash=token_hash(login_code),
                    user_id=user.user_id,
                    idp_id=row.idp_id,
                    link_method=method,
                    return_to=return_to,
                    code_challenge=row.client_code_challenge,
                    expires_at=now() + timedelta(seconds=settings.sso_login_code_ttl_s),
                )
            )
        return Redirect(with_query(return_to, {"login_code": login_code}))
    except Problem as exc:
        if return_to is None:
            raise
        return Redirect(with_query(return_to, {"error": exc.code, "error_description": exc.detail}))


async def _consume_state(session: AsyncSession, state: str) -> tuple[Row, bool]:
    """Lock and spend the state row (single use): (row, whether it was fresh). A known but spent or
    expired state with a return_to still tells where to send the browser back (validated at start)."""
    row = (
        await session.execute(
            select(
                sso_states.c.used_at,
                sso_states.c.expires_at,
                sso_states.c.code_verifier,
                sso_states.c.nonce,
                sso_states.c.redirect_uri,
                sso_states.c.return_to,
                sso_states.c.client_code_challenge,
                identity_providers.c.idp_id,
                identity_providers.c.tenant_id,
                identity_providers.c.issuer,
                identity_providers.c.client_id,
                identity_providers.c.client_secret,
                identity_providers.c.default_role,
            )
            .join(identity_providers, identity_providers.c.idp_id == sso_states.c.idp_id)
            .where(sso_states.c.state == state)
            .with_for_update(of=sso_states)
        )
    ).first()
    spent = row is not None and (row.used_at is not None or row.expires_at <= now())
    if row is None or (spent and row.return_to is None):
        raise StateInvalid("the sign-in request is unknown, used or expired; start again")
    if spent:
        return row, False
    await session.execute(update(sso_states).where(sso_states.c.state == state).values(used_at=func.now()))
    return row, True


async def _sign_in(
    sessions_: async_sessionmaker[AsyncSession], settings: Settings, metadata: idp.IdpMetadata, row: Row, code: str
) -> tuple[Row, str]:
    """Exchange the IdP's code (outside any transaction), verify the ID token, then link or provision
    the user (a refusal is audited and committed before it is raised)."""
    doc = await metadata.document(row.issuer)
    form = {
        "grant_type": "authorization_code",
        "code": code,
        "redirect_uri": row.redirect_uri,
        "code_verifier": row.code_verifier,
        "client_id": row.client_id,
    }
    if row.client_secret:  # sealed at rest; a session carries the keyring (no connection is opened)
        async with sessions_() as session:
            form["client_secret"] = keys.open_client_secret(session, row.idp_id, row.client_secret)
    id_token = await metadata.exchange_code(row.issuer, doc["token_endpoint"], form)
    claims = await idp.verify_id_token(metadata, id_token, issuer=row.issuer, client_id=row.client_id, nonce=row.nonce)
    refusal: Problem | None = None
    async with sessions_() as session, session.begin():
        try:
            return await _link(session, row, claims)
        except Problem as exc:  # refusals are audited: commit the record, then answer
            refusal = exc
            await audit.record(
                session,
                service=SERVICE,
                actor=SSO_ACTOR,
                action="identity.federation.link",
                resource_type="identity_provider",
                resource_id=row.idp_id,
                tenant_id=row.tenant_id,
                outcome="denied",
                after={"subject": claims.get("sub"), "email": claims.get("email")},
                reason=exc.code,
            )
    assert refusal is not None
    raise refusal


async def exchange_login_code(
    sessions_: async_sessionmaker[AsyncSession],
    settings: Settings,
    *,
    code: str,
    code_verifier: str | None,
    client: Client,
) -> views.TokenResponse:
    """`grant_type=sso_login_code`: the code a finished SSO login handed to return_to becomes a session,
    exactly once (a second presentation, or an expired code, is `invalid_grant`). A code carries the
    starting client's S256 challenge: a missing or wrong `code_verifier` is `invalid_grant` too, and the
    code is spent all the same (committed before the refusal), so a code seen in a URL cannot be tried
    again, not even with the right verifier afterwards."""
    grant_: views.TokenResponse | None = None  # None when refused
    async with sessions_() as session, session.begin():
        row = (
            await session.execute(
                select(sso_login_codes).where(sso_login_codes.c.code_hash == token_hash(code)).with_for_update()
            )
        ).first()
        if row is None or row.used_at is not None or row.expires_at <= now():
            raise Problem("the login code is unknown, used or expired; sign in again", code="invalid_grant")
        await session.execute(
            update(sso_login_codes).where(sso_login_codes.c.code_hash == row.code_hash).values(used_at=func.now())
        )
        user = (await session.execute(select(users).where(users.c.user_id == row.user_id))).one()
        refused = row.code_challenge is not None and not verifier_matches(row.code_challenge, code_verifier)
        if refused:  # someone else's redemption (the code leaked from a URL) or a broken client: recorded
            await audit.record(
                session,
                service=SERVICE,
                actor=SSO_ACTOR,
                action="identity.session.create",
                resource_type="user",
                resource_id=user.user_id,
                tenant_id=user.tenant_id,
                outcome="denied",
                reason="code_verifier_mismatch" if code_verifier else "code_verifier_missing",
                after={"method": "sso", "source": client.ip, "idp_id": str(row.idp_id)},
            )
        else:
            if user.status != "active":
                raise Forbidden("this account is disabled", code="account_disabled")
            grant_ = await open_session(session, settings, user=user, method="sso", client=client, idp_id=row.idp_id)
    if grant_ is None:  # refused, raised only now: the code's spending (and the audit record) above are committed
        raise Problem(
            "the code_verifier is missing or does not match the code_challenge this sign-in started with; "
            "the login code is spent: sign in again",
            code="invalid_grant",
        )
    return grant_.model_copy(update={"link_method": row.link_method})


async def _link(session: AsyncSession, provider: Row, claims: dict[str, Any]) -> tuple[Row, str]:
    subject = str(claims["sub"])
    linked = (
        await session.execute(
            select(users)
            .join(federated_identities, federated_identities.c.user_id == users.c.user_id)
            .where(federated_identities.c.idp_id == provider.idp_id, federated_identities.c.subject == subject)
        )
    ).first()
    if linked is not None:
        if linked.status != "active":
            raise Forbidden("this account is disabled", code="account_disabled")
        return linked, "existing_link"

    email = str(claims.get("email") or "")
    # An IdP that passes on only verified emails (identity itself does) sends none for an unverified one.
    if not email or "@" not in email or claims.get("email_verified") is not True:
        raise Forbidden("the identity provider has not verified this email", code="email_not_verified")
    domain = email_domain(email)
    owner = (
        await session.execute(
            select(idp_domains.c.idp_id).where(idp_domains.c.domain == domain, idp_domains.c.verified_at.is_not(None))
        )
    ).scalar()
    if owner != provider.idp_id:
        raise Forbidden(f"the domain {domain} is not owned by this identity provider", code="email_domain_not_owned")

    existing = (
        await session.execute(select(users).where(func.lower(users.c.email) == email.lower()).with_for_update())
    ).first()
    method: Literal["verified_email", "jit"]
    if existing is not None:
        if existing.tenant_id != provider.tenant_id:
            raise Forbidden(
                "an account with this email exists outside this organisation; it is not linked automatically",
                code="account_link_refused",
            )
        if existing.status != "active":
            raise Forbidden("this account is disabled", code="account_disabled")
        user, method = existing, "verified_email"
        await session.execute(update(users).where(users.c.user_id == user.user_id).values(email_verified=True))
    else:
        user, method = await _provision(session, provider, claims, email), "jit"

    await session.execute(
        insert(federated_identities).values(
            idp_id=provider.idp_id, subject=subject, user_id=user.user_id, email=email, link_method=method
        )
    )
    state = identity_events.FederatedIdentityState(
        user_id=user.user_id,
        tenant_id=provider.tenant_id,
        idp_id=provider.idp_id,
        subject=subject,
        email=email,
        link_method=method,
    )
    await record_change(
        session,
        identity_events.FederatedIdentityLinked,
        state,
        actor=SSO_ACTOR,
        action="identity.federation.link",
        resource_type="user",
        resource_id=user.user_id,
        tenant_id=provider.tenant_id,
    )
    return user, method


async def _provision(session: AsyncSession, provider: Row, claims: dict[str, Any], email: str) -> Row:
    """A user of the IdP's tenant, just in time, with the IdP's default role (if it has one)."""
    user_id = await insert_user(
        session,
        None,
        email=email,
        password=None,
        display_name=str(claims.get("name") or ""),
        tenant_id=provider.tenant_id,
        email_verified=True,
        actor=SSO_ACTOR,
    )
    if provider.default_role:
        await grant(
            session,
            None,
            user_id=user_id,
            scope=MembershipScope.tenant,
            role=Role(provider.default_role),
            tenant_id=provider.tenant_id,
            actor=SSO_ACTOR,
        )
    return (await session.execute(select(users).where(users.c.user_id == user_id))).one()
