"""Logins and tokens: password login with brute-force protection, sessions with rotating refresh
tokens (reuse revokes the whole session), logout, session listing/revocation, `client_credentials`
for service accounts.

Each use case is one or more short transactions; password hashing runs off the event loop and
outside any transaction. A failed attempt is committed before the error is raised, so lockout
counting is never rolled back with the request.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import case, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.contracts import Actor, new_event_id
from gpuaas.contracts.events import identity as ev
from gpuaas.identity import keys
from gpuaas.identity.models import (
    identity_providers,
    idp_domains,
    login_throttle,
    refresh_tokens,
    service_accounts,
    sessions,
    users,
)
from gpuaas.identity.passwords import verify_password
from gpuaas.identity.settings import Settings
from gpuaas.kit import audit
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Forbidden, NotFound, Problem, TooManyRequests, Unauthorized
from gpuaas.kit.outbox import add_event

SERVICE = "identity"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_secret(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Client:
    """Where a login comes from (recorded on the session, used for per-source throttling)."""

    ip: str = "unknown"
    user_agent: str | None = None


class AccountLocked(Problem):
    status, code, title = 423, "account_locked", "Account locked"


# ------------------------------------------------------------------------------------ throttling


async def _throttle_state(session: AsyncSession, key: str) -> Any:
    return (await session.execute(select(login_throttle).where(login_throttle.c.key == key))).first()


async def check_throttle(session: AsyncSession, settings: Settings, *, email: str, ip: str) -> None:
    t = now()
    acct = await _throttle_state(session, f"acct:{email.lower()}")
    if acct is not None and acct.locked_until is not None and acct.locked_until > t:
        retry = int((acct.locked_until - t).total_seconds()) + 1
        raise AccountLocked(f"too many failed logins; this account is locked for {retry}s", retry_after_s=retry)
    src = await _throttle_state(session, f"ip:{ip}")
    if (
        src is not None
        and src.failures >= settings.source_threshold
        and src.window_started_at > t - timedelta(seconds=settings.lockout_window_s)
    ):
        raise TooManyRequests("too many failed logins from this address; try again later", code="too_many_attempts")


async def _count_failure(session: AsyncSession, settings: Settings, key: str, lock: bool) -> bool:
    """Add one failure to `key`'s window; lock it when `lock` and the threshold is reached. True if locked now."""
    t = now()
    window = timedelta(seconds=settings.lockout_window_s)
    stmt = pg_insert(login_throttle).values(key=key, failures=1, window_started_at=t)
    stmt = stmt.on_conflict_do_update(
        index_elements=["key"],
        set_={
            # A window that has run out starts over.
            "failures": case((login_throttle.c.window_started_at < t - window, 1), else_=login_throttle.c.failures + 1),
            "window_started_at": case(
                (login_throttle.c.window_started_at < t - window, t), else_=login_throttle.c.window_started_at
            ),
        },
    ).returning(login_throttle.c.failures)
    failures = (await session.execute(stmt)).scalar_one()
    if lock and failures >= settings.lockout_threshold:
        await session.execute(
            update(login_throttle)
            .where(login_throttle.c.key == key)
            .values(locked_until=t + timedelta(seconds=settings.lockout_s), failures=0, window_started_at=t)
        )
        return True
    return False


async def record_failure(
    sessions_: async_sessionmaker[AsyncSession], settings: Settings, *, email: str, ip: str
) -> None:
    async with sessions_() as session, session.begin():
        locked = await _count_failure(session, settings, f"acct:{email.lower()}", lock=True)
        await _count_failure(session, settings, f"ip:{ip}", lock=False)
        if locked:
            await audit.record(
                session,
                service=SERVICE,
                actor=Actor.system("identity-login"),
                action="identity.account.lock",
                resource_type="account",
                resource_id=email.lower(),
                after={"locked_for_s": settings.lockout_s, "source": ip},
                reason="too many failed logins",
            )


# --------------------------------------------------------------------------------- password login


async def authenticate_password(
    sessions_: async_sessionmaker[AsyncSession], settings: Settings, *, email: str, password: str, client: Client
) -> Any:
    """Check the throttle, the password, the account and whether SSO is required. Returns the user row."""
    async with sessions_() as session:
        await check_throttle(session, settings, email=email, ip=client.ip)
        row = (await session.execute(select(users).where(func.lower(users.c.email) == email.lower()))).first()
    ok = await asyncio.to_thread(verify_password, row.password_hash if row else None, password)
    if not ok or row is None:
        await record_failure(sessions_, settings, email=email, ip=client.ip)
        raise Unauthorized("the email or password is wrong", code="invalid_credentials")
    if row.status != "active":
        raise Forbidden("this account is disabled", code="account_disabled")
    async with sessions_() as session:
        idp = await sso_enforced_for(session, row)
    if idp is not None:
        raise Forbidden(
            "this organisation signs in with its identity provider",
            code="sso_required",
            idp_id=str(idp.idp_id),
            sso_start_url=f"{settings.public_url}/auth/sso/start?idp_id={idp.idp_id}",
        )
    return row


async def sso_enforced_for(session: AsyncSession, user: Any) -> Any:
    """The enforcing IdP of the user's tenant that owns the user's email domain (operators are exempt)."""
    if user.tenant_id is None or "@" not in user.email:
        return None
    domain = user.email.rsplit("@", 1)[1].lower()
    return (
        await session.execute(
            select(identity_providers.c.idp_id)
            .join(idp_domains, idp_domains.c.idp_id == identity_providers.c.idp_id)
            .where(
                idp_domains.c.domain == domain,
                identity_providers.c.tenant_id == user.tenant_id,
                identity_providers.c.enforce_sso.is_(True),
                identity_providers.c.enabled.is_(True),
            )
        )
    ).first()


async def password_login(
    sessions_: async_sessionmaker[AsyncSession], settings: Settings, *, email: str, password: str, client: Client
) -> dict[str, Any]:
    row = await authenticate_password(sessions_, settings, email=email, password=password, client=client)
    async with sessions_() as session, session.begin():
        await session.execute(
            update(login_throttle).where(login_throttle.c.key == f"acct:{email.lower()}").values(failures=0)
        )
        return await open_session(session, settings, user=row, method="password", client=client)


async def open_session(
    session: AsyncSession,
    settings: Settings,
    *,
    user: Any,
    method: str,
    client: Client,
    idp_id: uuid.UUID | None = None,
) -> dict[str, Any]:
    """Start a session: a refresh-token family plus a first access token."""
    session_id = new_event_id()
    t = now()
    await session.execute(
        insert(sessions).values(
            session_id=session_id,
            user_id=user.user_id,
            method=method,
            idp_id=idp_id,
            user_agent=(client.user_agent or "")[:300] or None,
            client_ip=client.ip,
            expires_at=t + timedelta(seconds=settings.session_max_age_s),
        )
    )
    await session.execute(update(users).where(users.c.user_id == user.user_id).values(last_login_at=t))
    refresh = await _new_refresh_token(session, settings, session_id, t + timedelta(seconds=settings.session_max_age_s))
    await audit.record(
        session,
        service=SERVICE,
        actor=Actor(kind="user", id=str(user.user_id)),
        action="identity.session.create",
        resource_type="session",
        resource_id=session_id,
        tenant_id=user.tenant_id,
        after={"method": method, "source": client.ip, **({"idp_id": str(idp_id)} if idp_id else {})},
    )
    return await _token_response(session, settings, user, session_id, refresh)


async def _new_refresh_token(
    session: AsyncSession, settings: Settings, session_id: uuid.UUID, session_expires: datetime
) -> str:
    token = new_secret("rt")
    expires = min(now() + timedelta(seconds=settings.refresh_token_ttl_s), session_expires)
    await session.execute(
        insert(refresh_tokens).values(token_hash=token_hash(token), session_id=session_id, expires_at=expires)
    )
    return token


async def _token_response(
    session: AsyncSession, settings: Settings, user: Any, session_id: uuid.UUID, refresh: str
) -> dict[str, Any]:
    claims = keys.access_claims(
        issuer=settings.public_url,
        subject=user.user_id,
        kind="user",
        ttl_s=settings.access_token_ttl_s,
        tenant_id=user.tenant_id,
        email=user.email,
    )
    claims["sid"] = str(session_id)
    return {
        "access_token": await keys.sign(session, claims),
        "token_type": "Bearer",
        "expires_in": settings.access_token_ttl_s,
        "refresh_token": refresh,
        "session_id": session_id,
    }


# ------------------------------------------------------------------------------------ refresh


async def refresh(
    sessions_: async_sessionmaker[AsyncSession], settings: Settings, *, refresh_token: str
) -> dict[str, Any]:
    """Rotate: the presented token is spent and a new one issued. Presenting a spent token again is
    reuse (a stolen copy or a replay): the whole session is revoked and the caller must log in again."""
    reused = False
    result: dict[str, Any] = {}
    return_error: Problem | None = None
    async with sessions_() as session, session.begin():
        row = (
            await session.execute(
                select(refresh_tokens, sessions.c.user_id, sessions.c.revoked_at, sessions.c.expires_at.label("sx"))
                .join(sessions, sessions.c.session_id == refresh_tokens.c.session_id)
                .where(refresh_tokens.c.token_hash == token_hash(refresh_token))
                .with_for_update(of=refresh_tokens)
            )
        ).first()
        if row is None:
            raise Unauthorized("unknown refresh token", code="invalid_refresh_token")
        if row.revoked_at is not None:
            raise Unauthorized("this session has been revoked; log in again", code="session_revoked")
        if row.used_at is not None:
            await _revoke(session, row.session_id, row.user_id, reason="refresh_token_reuse", actor=None)
            reused = True
        else:
            t = now()
            if row.expires_at <= t or row.sx <= t:
                raise Unauthorized("the refresh token has expired; log in again", code="refresh_token_expired")
            user = (await session.execute(select(users).where(users.c.user_id == row.user_id))).one()
            if user.status != "active":
                await _revoke(session, row.session_id, row.user_id, reason="account_disabled", actor=None)
                return_error = Forbidden("this account is disabled", code="account_disabled")
            else:
                await session.execute(
                    update(refresh_tokens).where(refresh_tokens.c.token_hash == row.token_hash).values(used_at=t)
                )
                await session.execute(
                    update(sessions).where(sessions.c.session_id == row.session_id).values(last_used_at=t)
                )
                new = await _new_refresh_token(session, settings, row.session_id, row.sx)
                result = await _token_response(session, settings, user, row.session_id, new)
    if reused:
        raise Unauthorized(
            "this refresh token was already used; the session has been revoked", code="refresh_token_reused"
        )
    if return_error is not None:
        raise return_error
    return result


async def _revoke(
    session: AsyncSession, session_id: uuid.UUID, user_id: uuid.UUID, *, reason: str, actor: Principal | None
) -> bool:
    done = (
        await session.execute(
            update(sessions)
            .where(sessions.c.session_id == session_id, sessions.c.revoked_at.is_(None))
            .values(revoked_at=func.now(), revoked_reason=reason)
            .returning(sessions.c.session_id)
        )
    ).first()
    if done is None:
        return False
    who = actor.actor if actor else Actor.system("identity-sessions")
    state = ev.SessionState(session_id=session_id, user_id=user_id, revoked=True, revoked_reason=reason)
    await add_event(session, ev.SessionRevoked.build(subject=session_id, data=state, source=SERVICE, actor=who))
    await audit.record(
        session,
        service=SERVICE,
        actor=who,
        action="identity.session.revoke",
        resource_type="session",
        resource_id=session_id,
        before={"revoked": False},
        after={"revoked": True},
        reason=reason,
    )
    return True


async def revoke_user_sessions(session: AsyncSession, user_id: uuid.UUID, *, reason: str, actor: Principal) -> int:
    rows = await session.execute(
        select(sessions.c.session_id).where(sessions.c.user_id == user_id, sessions.c.revoked_at.is_(None))
    )
    count = 0
    for (sid,) in rows.all():
        count += await _revoke(session, sid, user_id, reason=reason, actor=actor)
    return count


# ----------------------------------------------------------------------------- logout, sessions


async def logout(
    sessions_: async_sessionmaker[AsyncSession],
    *,
    principal: Principal | None,
    session_id: uuid.UUID | None,
    refresh_token: str | None,
) -> None:
    async with sessions_() as session, session.begin():
        if refresh_token:
            row = (
                await session.execute(
                    select(sessions.c.session_id, sessions.c.user_id)
                    .join(refresh_tokens, refresh_tokens.c.session_id == sessions.c.session_id)
                    .where(refresh_tokens.c.token_hash == token_hash(refresh_token))
                )
            ).first()
            if row is None:
                raise Unauthorized("unknown refresh token", code="invalid_refresh_token")
            await _revoke(session, row.session_id, row.user_id, reason="logout", actor=principal)
            return
        if principal is None or session_id is None:
            raise Unauthorized("log out with the session's access token or refresh token", code="missing_token")
        await _revoke(session, session_id, principal.subject, reason="logout", actor=principal)


async def list_sessions(session: AsyncSession, principal: Principal, *, current: uuid.UUID | None) -> list[dict]:
    rows = await session.execute(
        select(sessions)
        .where(sessions.c.user_id == principal.subject)
        .order_by(sessions.c.created_at.desc())
        .limit(200)
    )
    return [
        {
            "session_id": r.session_id,
            "method": r.method,
            "idp_id": r.idp_id,
            "user_agent": r.user_agent,
            "client_ip": r.client_ip,
            "created_at": r.created_at,
            "last_used_at": r.last_used_at,
            "expires_at": r.expires_at,
            "revoked": r.revoked_at is not None,
            "revoked_reason": r.revoked_reason,
            "current": r.session_id == current,
        }
        for r in rows
    ]


async def revoke_own_session(session: AsyncSession, principal: Principal, session_id: uuid.UUID) -> None:
    row = (
        await session.execute(
            select(sessions.c.user_id).where(
                sessions.c.session_id == session_id, sessions.c.user_id == principal.subject
            )
        )
    ).first()
    if row is None:  # someone else's session is indistinguishable from none
        raise NotFound("session not found", code="session_not_found")
    await _revoke(session, session_id, principal.subject, reason="revoked_by_user", actor=principal)


# -------------------------------------------------------------------------- client credentials


async def client_credentials(
    sessions_: async_sessionmaker[AsyncSession],
    settings: Settings,
    *,
    client_id: str,
    client_secret: str,
    scope: str | None,
    client: Client,
) -> dict[str, Any]:
    async with sessions_() as session:
        await check_throttle(session, settings, email=f"client:{client_id}", ip=client.ip)
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
        await record_failure(sessions_, settings, email=f"client:{client_id}", ip=client.ip)
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
    return {
        "access_token": token,
        "token_type": "Bearer",
        "expires_in": settings.access_token_ttl_s,
        "scope": " ".join(granted),
    }
