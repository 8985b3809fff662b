"""Brute-force protection for logins: failures counted per account and per source address over a
sliding window (`lockout_window_s`).

- An account (an email, or `client:<id>` for a service account) is locked for `lockout_s` once it
  reaches `lockout_threshold` failures: 423 `account_locked`, even with the right password.
- A source address reaching `source_threshold` failures is refused (429 `too_many_attempts`) for
  every account until its window runs out; other addresses are not affected.

Every function takes the time it decides at (`at`), so the window can be tested without sleeping.
A failure is committed in its own transaction, so it is never rolled back with the failed request.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import Row, case, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuaas.contracts import Actor
from gpuaas.identity import SERVICE
from gpuaas.identity.models import login_throttle
from gpuaas.identity.settings import Settings
from gpuaas.kit import audit
from gpuaas.kit.errors import Problem, TooManyRequests


class AccountLocked(Problem):
    status, code, title = 423, "account_locked", "Account locked"


def account_key(account: str) -> str:
    return f"acct:{account.lower()}"


def source_key(ip: str) -> str:
    return f"ip:{ip}"


async def _state(session: AsyncSession, key: str) -> Row | None:
    return (await session.execute(select(login_throttle).where(login_throttle.c.key == key))).first()


async def check(session: AsyncSession, settings: Settings, *, account: str, ip: str, at: datetime) -> None:
    """Refuse the attempt if the account is locked or its source address has failed too often."""
    acct = await _state(session, account_key(account))
    if acct is not None and acct.locked_until is not None and acct.locked_until > at:
        retry = int((acct.locked_until - at).total_seconds()) + 1
        raise AccountLocked(f"too many failed logins; this account is locked for {retry}s", retry_after_s=retry)
    src = await _state(session, source_key(ip))
    if (
        src is not None
        and src.failures >= settings.source_threshold
        and src.window_started_at > at - timedelta(seconds=settings.lockout_window_s)
    ):
        raise TooManyRequests("too many failed logins from this address; try again later", code="too_many_attempts")


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
    return False


async def record_failure(
    sessions_: async_sessionmaker[AsyncSession], settings: Settings, *, account: str, ip: str, at: datetime
) -> None:
    """Count a failed attempt against the account and the source address (committed at once)."""
    async with sessions_() as session, session.begin():
        locked = await _count_failure(session, settings, account_key(account), lock=True, at=at)
        await _count_failure(session, settings, source_key(ip), lock=False, at=at)
        if locked:
            await audit.record(
                session,
                service=SERVICE,
                actor=Actor.system("identity-login"),
                action="identity.account.lock",
                resource_type="account",
                resource_id=account.lower(),
                after={"locked_for_s": settings.lockout_s, "source": ip},
                reason="too many failed logins",
            )


async def clear_account(session: AsyncSession, account: str) -> None:
    """A successful login forgets the account's failures (the source address keeps its count)."""
    await session.execute(update(login_throttle).where(login_throttle.c.key == account_key(account)).values(failures=0))
