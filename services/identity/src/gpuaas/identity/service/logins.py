"""Logins: the password grant (local users, brute-force throttled, refused where the tenant enforces
SSO) and `client_credentials` (project service accounts).

Password hashing runs off the event loop and outside any transaction; a failed attempt is committed
before the error is raised, so its count is never rolled back with the request.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from collections.abc import Callable
from datetime import datetime

from sqlalchemy import Row, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.identity import keys
from gpuaas.identity.credentials import Client, now, token_hash
from gpuaas.identity.domain import email_domain
from gpuaas.identity.models import identity_providers, idp_domains, service_accounts, users
from gpuaas.identity.passwords import verify_password
from gpuaas.identity.service import throttle, views
from gpuaas.identity.service.sessions import open_session
from gpuaas.identity.settings import Settings
from gpuaas.kit.errors import Forbidden, Problem, Unauthorized

Clock = Callable[[], datetime]


async def authenticate_password(
    sessions_: async_sessionmaker[AsyncSession],
    settings: Settings,
    *,
    email: str,
    password: str,
    client: Client,
    clock: Clock = now,
) -> Row:
    """Check the throttle, the password, the account and whether SSO is required. Returns the user row."""
    async with sessions_() as session:
        await throttle.check(session, settings, account=email, ip=client.ip, at=clock())
        row = (await session.execute(select(users).where(func.lower(users.c.email) == email.lower()))).first()
    ok = await asyncio.to_thread(verify_password, row.password_hash if row else None, password)
    if not ok or row is None:
        await throttle.record_failure(sessions_, settings, account=email, ip=client.ip, at=clock())
        raise Unauthorized("the email or password is wrong", code="invalid_credentials")
    if row.status != "active":
        raise Forbidden("this account is disabled", code="account_disabled")
    async with sessions_() as session:
        idp_id = await sso_enforced_for(session, row)
    if idp_id is not None:
        raise Forbidden(
            "this organisation signs in with its identity provider",
            code="sso_required",
            idp_id=str(idp_id),
            sso_start_url=f"{settings.public_url}/auth/sso/start?idp_id={idp_id}",
        )
    return row


async def sso_enforced_for(session: AsyncSession, user: Row) -> uuid.UUID | None:
    """The enforcing IdP of the user's tenant that owns the user's email domain (operators are exempt)."""
    if user.tenant_id is None or "@" not in user.email:
        return None
    idp_id: uuid.UUID | None = (
        await session.execute(
            select(identity_providers.c.idp_id)
            .join(idp_domains, idp_domains.c.idp_id == identity_providers.c.idp_id)
            .where(
                idp_domains.c.domain == email_domain(user.email),
                idp_domains.c.verified_at.is_not(None),  # only a proven domain can take password logins away
                identity_providers.c.tenant_id == user.tenant_id,
                identity_providers.c.enforce_sso.is_(True),
                identity_providers.c.enabled.is_(True),
            )
        )
    ).scalar()
    return idp_id


async def password_login(
    sessions_: async_sessionmaker[AsyncSession],
    settings: Settings,
    *,
    email: str,
    password: str,
    client: Client,
    clock: Clock = now,
) -> views.TokenResponse:
    row = await authenticate_password(sessions_, settings, email=email, password=password, client=client, clock=clock)
    async with sessions_() as session, session.begin():
        await throttle.clear_account(session, settings, email, client.ip, clock())
        return await open_session(session, settings, user=row, method="password", client=client)


async def client_credentials(
    sessions_: async_sessionmaker[AsyncSession],
    settings: Settings,
    *,
    client_id: str,
    client_secret: str,
    scope: str | None,
    client: Client,
    clock: Clock = now,
) -> views.TokenResponse:
    """A service account's access token (no refresh token), for the scopes asked (all it holds by default).
    Throttled per source address only: a client_id is visible, so a per-client limit would let anyone lock
    a service account out, and its secret is not guessable."""
    async with sessions_() as session:
        await throttle.check(session, settings, account=None, ip=client.ip, at=clock())
        try:
            sa_id = uuid.UUID(client_id)
        except ValueError:
            sa_id = None
        row = (
            (
                await session.execute(select(service_accounts).where(service_accounts.c.service_account_id == sa_id))
            ).first()
            if sa_id
            else None
        )
    if row is None or not hmac.compare_digest(row.secret_hash, token_hash(client_secret)):
        await throttle.record_failure(sessions_, settings, account=None, ip=client.ip, at=clock())
        raise Unauthorized("unknown client or wrong secret", code="invalid_client")
    if row.disabled:
        raise Forbidden("this service account is disabled", code="client_disabled")
    granted = list(row.scopes)
    if scope:
        wanted = scope.split()
        extra = [s for s in wanted if s not in granted]
        if extra:
            raise Problem(f"scopes not granted to this service account: {' '.join(extra)}", code="invalid_scope")
        granted = wanted
    claims = keys.access_claims(
        issuer=settings.public_url,
        subject=row.service_account_id,
        kind="service_account",
        ttl_s=settings.access_token_ttl_s,
        tenant_id=row.tenant_id,
        project_id=row.project_id,
        scopes=granted,
    )
    async with sessions_() as session:
        token = await keys.sign(session, claims)
    return views.TokenResponse(
        access_token=token,
        token_type="Bearer",
        expires_in=settings.access_token_ttl_s,
        scope=" ".join(granted),
    )
