"""Brute-force protection for logins that an attacker cannot aim at a victim, over a sliding window
(`lockout_window_s`):

- Per source address: `source_threshold` failures from one address (any account) refuse every further
  login from it (429 `too_many_attempts`) until its window runs out; other addresses are not affected.
- Per account *and* source: `lockout_threshold` failures for one account from one address make that
  address back off from that account for `lockout_s` (429 `login_backoff`, with Retry-After). The account
  itself is never locked: the right password from any other address still logs in, so guessing wrong
  passwords for someone's email cannot lock them out.
- Per account, all sources together: counted only (audited when it reaches `lockout_threshold`), never
  refused on, for the same reason.

Service accounts (`client_credentials`) are throttled per source address only: their secret is 256 bits
of randomness (not guessable), and their `client_id` is visible, so a per-client limit would only let
anyone lock a service account out.

The address is the caller's as `gpuaas.kit.client_address` determines it (the right-most X-Forwarded-For
hop that is not a trusted proxy). Every function takes the time it decides at (`at`), so the window can
be tested without sleeping. A failure is committed in its own transaction, so it is never rolled back with
the failed request.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Row, case, delete, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.contracts import Actor
from gpuaas.identity import SERVICE
from gpuaas.identity.models import login_throttle
from gpuaas.identity.settings import Settings
from gpuaas.kit import audit
from gpuaas.kit.errors import TooManyRequests


def account_key(account: str) -> str:
    return f"acct:{account.lower()}"


def source_key(ip: str) -> str:
    return f"ip:{ip}"


def pair_key(account: str, ip: str) -> str:
    """One account from one address: what backs off (never the account as a whole)."""
    return f"pair:{ip}|{account.lower()}"


async def _state(session: AsyncSession, key: str) -> Row | None:
    return (await session.execute(select(login_throttle).where(login_throttle.c.key == key))).first()


async def check(session: AsyncSession, settings: Settings, *, account: str | None, ip: str, at: datetime) -> None:
    """Refuse the attempt if its source address has failed too often, or has failed too often for this
    account (`account` None: a service account, throttled per source only)."""
    src = await _state(session, source_key(ip))
    if (
        src is not None
        and src.failures >= settings.source_threshold
        and src.window_started_at > at - timedelta(seconds=settings.lockout_window_s)
    ):
        retry = int((src.window_started_at + timedelta(seconds=settings.lockout_window_s) - at).total_seconds()) + 1
        raise TooManyRequests(
            "too many failed logins from this address; try again later", code="too_many_attempts", retry_after_s=retry
        )
    if account is None:
        return
    pair = await _state(session, pair_key(account, ip))
    if pair is not None and pair.locked_until is not None and pair.locked_until > at:
        retry = int((pair.locked_until - at).total_seconds()) + 1
        raise TooManyRequests(
            f"too many failed logins for this account from this address; retry in {retry}s",
            code="login_backoff",
            retry_after_s=retry,
        )


async def _count_failure(session: AsyncSession, settings: Settings, key: str, *, lock: bool, at: datetime) -> bool:
    """Add one failure to `key`'s window; lock it when `lock` and the threshold is reached. True if locked now."""
    window = timedelta(seconds=settings.lockout_window_s)
    stmt = pg_insert(login_throttle).values(key=key, failures=1, window_started_at=at)
    stmt = stmt.on_conflict_do_update(
        index_elements=["key"],
        set_={
            # A window that has run out starts over.
            "failures": case(
                (login_throttle.c.window_started_at < at - window, 1), else_=login_throttle.c.failures + 1
            ),
            "window_started_at": case(
                (login_throttle.c.window_started_at < at - window, at), else_=login_throttle.c.window_started_at
            ),
        },
    ).returning(login_throttle.c.failures)
    failures = (await session.execute(stmt)).scalar_one()
    if lock and failures >= settings.lockout_threshold:
        await session.execute(
            update(login_throttle)
            .where(login_throttle.c.key == key)
            .values(locked_until=at + timedelta(seconds=settings.lockout_s), failures=0, window_started_at=at)
        )
        return True
    return failures == settings.lockout_threshold  # account-wide: report reaching it once per window


async def record_failure(
    sessions_: async_sessionmaker[AsyncSession], settings: Settings, *, account: str | None, ip: str, at: datetime
) -> None:
    """Count a failed attempt against the source address and, for a user, the account from that address
    and the account as a whole (committed at once)."""
    async with sessions_() as session, session.begin():
        await _count_failure(session, settings, source_key(ip), lock=False, at=at)
        if account is None:
            return
        backoff = await _count_failure(session, settings, pair_key(account, ip), lock=True, at=at)
        targeted = await _count_failure(session, settings, account_key(account), lock=False, at=at)
        if backoff or targeted:
            await audit.record(
                session,
                service=SERVICE,
                actor=Actor.system("identity-login"),
                action="identity.account.login_backoff" if backoff else "identity.account.failed_logins",
                resource_type="account",
                resource_id=account.lower(),
                after={"source": ip, **({"backoff_s": settings.lockout_s} if backoff else {})},
                reason="too many failed logins"
                + (" from this source" if backoff else " from all sources (the account is not locked)"),
            )


async def clear_account(session: AsyncSession, account: str, ip: str) -> None:
    """A successful login forgets the account's failures from that address (the address keeps its count)."""
    await session.execute(delete(login_throttle).where(login_throttle.c.key == pair_key(account, ip)))
    await session.execute(update(login_throttle).where(login_throttle.c.key == account_key(account)).values(failures=0))
