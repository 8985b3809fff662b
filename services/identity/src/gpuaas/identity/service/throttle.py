"""Brute-force protection for logins that an attacker cannot aim at a victim, over a sliding window
(`lockout_window_s`):

- Per source address: `source_threshold` failures from one address (any account) refuse further logins
  from it (429 `too_many_attempts`) until its window runs out; other addresses are not affected. An
  account that signed in from that address before (within `known_source_ttl_s`) is exempt: a source's
  failures (say, a shared NAT or a devstack where everyone is 127.0.0.1) never lock out an account its
  owner already uses from there; guessing at that account is still bounded by its own backoff below.
- Per account *and* source: `lockout_threshold` failures for one account from one address make that
  address back off from that account (429 `login_backoff`, with Retry-After), for `lockout_s`, doubled at
  each further backoff within `backoff_memory_s`, at most `lockout_max_s`. The account itself is never
  locked: the right password from any other address still logs in, so guessing wrong passwords for
  someone's email cannot lock them out.
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

import random
from datetime import datetime, timedelta

from sqlalchemy import Row, case, delete, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.contracts import Actor
from gpuaas.identity import SERVICE
from gpuaas.identity.models import login_throttle
from gpuaas.identity.settings import Settings
from gpuaas.kit import audit
from gpuaas.kit.errors import TooManyRequests

PRUNE_PROBABILITY = 0.01


def account_key(account: str) -> str:
    return f"acct:{account.lower()}"


def source_key(ip: str) -> str:
    return f"ip:{ip}"


def pair_key(account: str, ip: str) -> str:
    """One account from one address: what backs off (never the account as a whole)."""
    return f"pair:{ip}|{account.lower()}"


def backoffs_key(account: str, ip: str) -> str:
    """How many backoffs one account from one address had lately (each one lasts twice the previous)."""
    return f"backoffs:{ip}|{account.lower()}"


def known_key(account: str, ip: str) -> str:
    """The account signed in from this address (`window_started_at`: the last time): exempt from the
    address's own throttle."""
    return f"known:{ip}|{account.lower()}"


def backoff_s(settings: Settings, backoffs: int) -> int:
    """The length of the `backoffs`-th backoff in a row (1-based): doubling from `lockout_s`, capped."""
    return min(settings.lockout_s * 2 ** min(max(backoffs - 1, 0), 30), settings.lockout_max_s)


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
        and not await _known(session, settings, account, ip, at)
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


async def _known(session: AsyncSession, settings: Settings, account: str | None, ip: str, at: datetime) -> bool:
    if account is None:
        return False
    row = await _state(session, known_key(account, ip))
    return row is not None and row.window_started_at > at - timedelta(seconds=settings.known_source_ttl_s)


async def _count(session: AsyncSession, key: str, *, window: timedelta, at: datetime) -> int:
    """Add one to `key`'s count in its window (a window that has run out starts over); the new count."""
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
    count: int = (await session.execute(stmt)).scalar_one()
    return count


async def _count_failure(
    session: AsyncSession, settings: Settings, key: str, *, backoffs: str | None, at: datetime
) -> int | None:
    """Add one failure to `key`'s window. With `backoffs` (the key counting its backoffs), back `key` off
    when the threshold is reached and return the backoff's length in seconds; without, return a length
    only for reaching the threshold (once per window: the account-wide count, never refused on)."""
    failures = await _count(session, key, window=timedelta(seconds=settings.lockout_window_s), at=at)
    if backoffs is not None and failures >= settings.lockout_threshold:
        nth = await _count(session, backoffs, window=timedelta(seconds=settings.backoff_memory_s), at=at)
        length = backoff_s(settings, nth)
        await session.execute(
            update(login_throttle)
            .where(login_throttle.c.key == key)
            .values(locked_until=at + timedelta(seconds=length), failures=0, window_started_at=at)
        )
        return length
    return 0 if backoffs is None and failures == settings.lockout_threshold else None


async def record_failure(
    sessions_: async_sessionmaker[AsyncSession], settings: Settings, *, account: str | None, ip: str, at: datetime
) -> None:
    """Count a failed attempt against the source address and, for a user, the account from that address
    and the account as a whole (committed at once)."""
    async with sessions_() as session, session.begin():
        await _count_failure(session, settings, source_key(ip), backoffs=None, at=at)
        if account is None:
            return
        backoff = await _count_failure(
            session, settings, pair_key(account, ip), backoffs=backoffs_key(account, ip), at=at
        )
        targeted = await _count_failure(session, settings, account_key(account), backoffs=None, at=at)
        if backoff is not None or targeted is not None:
            await audit.record(
                session,
                service=SERVICE,
                actor=Actor.system("identity-login"),
                action="identity.account.login_backoff" if backoff is not None else "identity.account.failed_logins",
                resource_type="account",
                resource_id=account.lower(),
                after={"source": ip, **({"backoff_s": backoff} if backoff is not None else {})},
                reason="too many failed logins"
                + (" from this source" if backoff is not None else " from all sources (the account is not locked)"),
            )


async def clear_account(session: AsyncSession, settings: Settings, account: str, ip: str, at: datetime) -> None:
    """A successful login forgets the account's failures and backoffs from that address (the address keeps
    its own count) and notes the address as one the account is used from."""
    if random.random() < PRUNE_PROBABILITY:  # amortised clean-up of rows no rule reads any more
        kept_s = max(settings.known_source_ttl_s, settings.backoff_memory_s, settings.lockout_window_s)
        await session.execute(
            delete(login_throttle).where(
                login_throttle.c.window_started_at < at - timedelta(seconds=kept_s),
                or_(login_throttle.c.locked_until.is_(None), login_throttle.c.locked_until < at),
            )
        )
    await session.execute(
        delete(login_throttle).where(login_throttle.c.key.in_([pair_key(account, ip), backoffs_key(account, ip)]))
    )
    known = pg_insert(login_throttle).values(key=known_key(account, ip), failures=0, window_started_at=at)
    await session.execute(known.on_conflict_do_update(index_elements=["key"], set_={"window_started_at": at}))
    await session.execute(update(login_throttle).where(login_throttle.c.key == account_key(account)).values(failures=0))
