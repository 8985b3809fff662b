"""Login sessions: a session is a refresh-token family. Refresh tokens rotate on every use; presenting
a spent one again (a stolen copy or a replay) revokes the whole session. Logout, listing and revoking
one's own sessions, and revoking every session of a disabled account."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from sqlalchemy import Row, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.contracts import Actor, ActorKind, new_event_id
from gpuaas.contracts.events import identity as identity_events
from gpuaas.identity import SERVICE, keys
from gpuaas.identity.credentials import Client, new_secret, now, token_hash
from gpuaas.identity.models import refresh_tokens, sessions, users
from gpuaas.identity.service import views
from gpuaas.identity.service.common import emit
from gpuaas.identity.settings import Settings
from gpuaas.kit import audit
from gpuaas.kit.auth import Principal
from gpuaas.kit.errors import Forbidden, NotFound, Problem, Unauthorized


async def open_session(
    session: AsyncSession,
    settings: Settings,
    *,
    user: Row,
    method: str,
    client: Client,
    idp_id: uuid.UUID | None = None,
    link_method: str | None = None,
) -> views.TokenResponse:
    """Start a session for `user` (a users row): a refresh-token family plus a first access token."""
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
        actor=Actor(kind=ActorKind.user, id=str(user.user_id)),
        action="identity.session.create",
        resource_type="session",
        resource_id=session_id,
        tenant_id=user.tenant_id,
        after={"method": method, "source": client.ip, **({"idp_id": str(idp_id)} if idp_id else {})},
    )
    return await _token_grant(session, settings, user, session_id, refresh, link_method=link_method)


async def _new_refresh_token(
    session: AsyncSession, settings: Settings, session_id: uuid.UUID, session_expires: datetime
) -> str:
    token = new_secret("rt")
    expires = min(now() + timedelta(seconds=settings.refresh_token_ttl_s), session_expires)
    await session.execute(
        insert(refresh_tokens).values(token_hash=token_hash(token), session_id=session_id, expires_at=expires)
    )
    return token


async def _token_grant(
    session: AsyncSession,
    settings: Settings,
    user: Row,
    session_id: uuid.UUID,
    refresh: str,
    *,
    link_method: str | None = None,
) -> views.TokenResponse:
    claims = keys.access_claims(
        issuer=settings.public_url,
        subject=user.user_id,
        kind="user",
        ttl_s=settings.access_token_ttl_s,
        tenant_id=user.tenant_id,
        email=user.email,
    )
    claims["sid"] = str(session_id)
    return views.TokenResponse(
        access_token=await keys.sign(session, claims),
        token_type="Bearer",
        expires_in=settings.access_token_ttl_s,
        refresh_token=refresh,
        session_id=session_id,
        link_method=link_method,
    )


async def refresh(
    sessions_: async_sessionmaker[AsyncSession], settings: Settings, *, refresh_token: str
) -> views.TokenResponse:
    """Rotate: the presented token is spent and a new one issued. Presenting a spent token again is
    reuse (a stolen copy or a replay): the whole session is revoked and the caller must log in again."""
    # Refusals that revoke something are raised only after the revocation has committed.
    refusal: Problem | None = None
    grant: views.TokenResponse | None = None
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
            await revoke(session, row.session_id, row.user_id, reason="refresh_token_reuse", actor=None)
            refusal = Unauthorized(
                "this refresh token was already used; the session has been revoked", code="refresh_token_reused"
            )
        else:
            t = now()
            if row.expires_at <= t or row.sx <= t:
                raise Unauthorized("the refresh token has expired; log in again", code="refresh_token_expired")
            user = (await session.execute(select(users).where(users.c.user_id == row.user_id))).one()
            if user.status != "active":
                await revoke(session, row.session_id, row.user_id, reason="account_disabled", actor=None)
                refusal = Forbidden("this account is disabled", code="account_disabled")
            else:
                await session.execute(
                    update(refresh_tokens).where(refresh_tokens.c.token_hash == row.token_hash).values(used_at=t)
                )
                await session.execute(
                    update(sessions).where(sessions.c.session_id == row.session_id).values(last_used_at=t)
                )
                new = await _new_refresh_token(session, settings, row.session_id, row.sx)
                grant = await _token_grant(session, settings, user, row.session_id, new)
    if refusal is not None:
        raise refusal
    assert grant is not None  # every path that does not refuse grants
    return grant


async def revoke(
    session: AsyncSession, session_id: uuid.UUID, user_id: uuid.UUID, *, reason: str, actor: Principal | None
) -> bool:
    """End a session (every token of its family); False if it had already ended."""
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
    state = identity_events.SessionState(session_id=session_id, user_id=user_id, revoked=True, revoked_reason=reason)
    # emit(): identity's own deny list refuses the session's access tokens once this commits.
    await emit(session, identity_events.SessionRevoked.build(subject=session_id, data=state, source=SERVICE, actor=who))
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
        count += await revoke(session, sid, user_id, reason=reason, actor=actor)
    return count


async def logout(
    sessions_: async_sessionmaker[AsyncSession],
    *,
    principal: Principal | None,
    session_id: uuid.UUID | None,
    refresh_token: str | None,
) -> None:
    """End the session of the presented refresh token, or else of the (verified) access token."""
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
            await revoke(session, row.session_id, row.user_id, reason="logout", actor=principal)
            return
        if principal is None or session_id is None:
            raise Unauthorized("log out with the session's access token or refresh token", code="missing_token")
        await revoke(session, session_id, principal.subject, reason="logout", actor=principal)


async def list_sessions(
    session: AsyncSession, principal: Principal, *, current: uuid.UUID | None
) -> list[views.SessionInfo]:
    """The caller's own sessions, newest first; `current` marks the one the caller's token belongs to."""
    rows = await session.execute(
        select(sessions)
        .where(sessions.c.user_id == principal.subject)
        .order_by(sessions.c.created_at.desc())
        .limit(200)
    )
    return [
        views.SessionInfo(
            session_id=r.session_id,
            method=r.method,
            idp_id=r.idp_id,
            user_agent=r.user_agent,
            client_ip=r.client_ip,
            created_at=r.created_at,
            last_used_at=r.last_used_at,
            expires_at=r.expires_at,
            revoked=r.revoked_at is not None,
            revoked_reason=r.revoked_reason,
            current=r.session_id == current,
        )
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
    await revoke(session, session_id, principal.subject, reason="revoked_by_user", actor=principal)
