"""gpuaas.kit.revocation: the deny list every service's token verification checks, and the watch that ends
long-lived streams when their viewer loses access.

Access tokens are self-contained JWTs that live for minutes; identity events end them early:

- `session.revoked` (logout, `DELETE /sessions/{id}`, refresh-token reuse, a disabled account) denies
  every token carrying that `sid`;
- `user.updated` with `status: disabled`, `service_account.disabled` and
  `service_account.secret_rotated` deny every token of that subject issued before the event ("not before");
- membership, project and tenant changes deny nothing here (the IAM projection decides) but wake the
  streams of the users, projects and tenants concerned, which re-check their access at once.

Where it lives: the kit table `revocations` in each service's schema, written by the identity consumer in
the transaction that applies the event (so it survives restarts and a replay from the topic rebuilds it),
and an in-memory copy per process (`DenyList`) that the hot path reads: a set lookup and a dict lookup per
request, no I/O. The consuming process updates its copy when its transaction commits; every other replica
of the service (a consumer group spreads the topic's partitions over replicas) polls the table for rows
changed since its last look (`revocation_poll_interval_s`, default 0.5 s). Rows older than the longest
access-token lifetime can no longer matter and are pruned (`revocation_retention_s`).

Tokens are compared by `iat` (whole seconds) against a "not before" in microseconds: a token issued in the
same second as the revocation, even just after it, is refused too (a client fetches a new one a second later).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, TypeVar

from sqlalchemy import delete, event, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from gpuaas.contracts.events import identity as ev
from gpuaas.kit.errors import Forbidden, NotFound, Problem, Unauthorized, problem_body
from gpuaas.kit.logging import get_logger
from gpuaas.kit.subscriptions import Subscriptions
from gpuaas.kit.tables import revocations


class Principal(Protocol):
    """What the deny list reads of a verified caller (gpuaas.kit.auth.Principal; no import: auth imports this)."""

    @property
    def subject(self) -> uuid.UUID: ...
    @property
    def session_id(self) -> uuid.UUID | None: ...
    @property
    def issued_at(self) -> float | None: ...
    @property
    def expires_at(self) -> float | None: ...


log = get_logger(__name__)
T = TypeVar("T")

SESSION, SUBJECT, ACCESS = "session", "subject", "access"  # the kinds of rows in `revocations`
INFO_KEY = "gpuaas.revocations"  # where a service's sessions carry its DenyList (session.info)
STREAM_RECHECK_S = 30.0  # streams also re-check on a timer: a safety net for changes no row names


@dataclass(frozen=True)
class Change:
    kind: str
    key: uuid.UUID
    not_before: datetime | None = None


class DenyList:
    """The process's copy of the revocations, and the streams waiting for a change that concerns them."""

    def __init__(self) -> None:
        self.sessions: dict[uuid.UUID, float] = {}  # sid -> when it was revoked (epoch s, for pruning)
        self.not_before: dict[uuid.UUID, float] = {}  # subject -> epoch s; tokens issued before are dead
        self._watchers: dict[uuid.UUID, set[asyncio.Event]] = {}
        self._seen: dict[tuple[str, uuid.UUID], datetime] = {}  # (kind, key) -> updated_at already applied
        self._polled_to: datetime | None = None
        self.loaded = False

    # --- the hot path ---

    def check(self, principal: Principal) -> None:
        """Raise 401 if the token was revoked. Dict lookups only."""
        if principal.session_id is not None and principal.session_id in self.sessions:
            raise Unauthorized("this session has been revoked; sign in again", code="session_revoked")
        nb = self.not_before.get(principal.subject)
        if nb is not None and (principal.issued_at is None or principal.issued_at < nb):
            raise Unauthorized("this token was revoked; sign in again", code="token_revoked")

    # --- feeding ---

    def apply(self, changes: Iterable[Change]) -> None:
        woken: set[uuid.UUID] = set()
        for c in changes:
            stamp = c.not_before.timestamp() if c.not_before else time.time()
            if c.kind == SESSION:
                self.sessions[c.key] = stamp
            elif c.kind == SUBJECT and c.not_before is not None:
                self.not_before[c.key] = max(self.not_before.get(c.key, 0.0), stamp)
            woken.add(c.key)
        self.wake(woken)

    def wake(self, keys: Iterable[uuid.UUID]) -> None:
        for key in keys:
            for flag in self._watchers.get(key, ()):
                flag.set()

    def prune(self, retention_s: float) -> None:
        horizon = time.time() - retention_s
        self.sessions = {k: v for k, v in self.sessions.items() if v >= horizon}
        self.not_before = {k: v for k, v in self.not_before.items() if v >= horizon}

    @contextmanager
    def watching(self, keys: Iterable[uuid.UUID | None]) -> Generator[asyncio.Event, None, None]:
        """An event set whenever a change names one of `keys` (a user, session, project, tenant)."""
        flag = asyncio.Event()
        wanted = {k for k in keys if k is not None}
        for k in wanted:
            self._watchers.setdefault(k, set()).add(flag)
        try:
            yield flag
        finally:
            for k in wanted:
                flags = self._watchers.get(k)
                if flags is not None:
                    flags.discard(flag)
                    if not flags:
                        del self._watchers[k]

    # --- the table (startup load and the poll that keeps replicas in step) ---

    async def poll(self, sessions: async_sessionmaker[AsyncSession], retention_s: float) -> int:
        """Apply rows changed since the last poll (with an overlap: a transaction that committed late with an
        older timestamp is still seen); returns how many were new."""
        since = (self._polled_to - timedelta(seconds=10)) if self._polled_to else None
        async with sessions() as session:
            query = select(revocations)
            if since is None:
                horizon = datetime.now(UTC) - timedelta(seconds=retention_s)
                query = query.where(revocations.c.updated_at >= horizon)
            else:
                query = query.where(revocations.c.updated_at >= since)
            rows = (await session.execute(query.order_by(revocations.c.updated_at))).all()
        fresh = [r for r in rows if self._seen.get((r.kind, r.key)) != r.updated_at]
        for r in fresh:
            self._seen[(r.kind, r.key)] = r.updated_at
        if rows:
            self._polled_to = max(self._polled_to or rows[-1].updated_at, rows[-1].updated_at)
        elif self._polled_to is None:
            self._polled_to = datetime.now(UTC) - timedelta(seconds=1)
        self.apply(Change(r.kind, r.key, r.not_before) for r in fresh)
        self.loaded = True
        return len(fresh)

    async def run(
        self,
        sessions: async_sessionmaker[AsyncSession],
        stopping: asyncio.Event,
        *,
        interval_s: float,
        retention_s: float,
    ) -> None:
        """Poll the table until the service stops; prune the table and the copy now and then."""
        last_prune = 0.0
        while not stopping.is_set():
            try:
                await self.poll(sessions, retention_s)
                if time.monotonic() - last_prune > 60:
                    last_prune = time.monotonic()
                    await _prune_table(sessions, retention_s)
                    self.prune(retention_s)
                    horizon = datetime.now(UTC) - timedelta(seconds=retention_s)
                    self._seen = {k: v for k, v in self._seen.items() if v >= horizon}
            except Exception as exc:  # the database is away: keep the copy, try again
                log.warning("revocation_poll_failed", error=f"{type(exc).__name__}: {exc}")
            with suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), interval_s)


async def _prune_table(sessions: async_sessionmaker[AsyncSession], retention_s: float) -> None:
    async with sessions() as session, session.begin():
        horizon = datetime.now(UTC) - timedelta(seconds=retention_s)
        await session.execute(delete(revocations).where(revocations.c.updated_at < horizon))


# --- the identity consumer's side: event -> rows (+ this process's copy once the transaction commits) ---

subscriptions = Subscriptions()


def changes_of(e: ev.Event) -> list[Change]:
    """What an identity event revokes (SESSION/SUBJECT) or whom it concerns (ACCESS)."""
    d: Any = e.data
    if isinstance(e, ev.SessionRevoked):
        return [Change(SESSION, d.session_id), Change(ACCESS, d.user_id)] if d.revoked else []
    if isinstance(e, ev.UserUpdated):
        return [Change(SUBJECT, d.user_id, e.time) if d.status == "disabled" else Change(ACCESS, d.user_id)]
    if isinstance(e, (ev.ServiceAccountUpdated, ev.ServiceAccountDisabled, ev.ServiceAccountSecretRotated)):
        if d.disabled or not isinstance(e, ev.ServiceAccountUpdated):
            return [Change(SUBJECT, d.service_account_id, e.time)]
        return [Change(ACCESS, d.service_account_id)]
    if isinstance(e, (ev.MembershipChanged, ev.MembershipRevoked)):
        return [Change(ACCESS, d.user_id)]
    if isinstance(e, ev.ProjectUpdated):
        return [Change(ACCESS, d.project_id)]
    if isinstance(e, ev.TenantUpdated):
        return [Change(ACCESS, d.tenant_id)]
    return []


async def record(session: AsyncSession, changes: list[Change]) -> None:
    """Upsert the rows (a later "not before" wins) and, on commit, apply them to this process's copy."""
    for c in changes:
        stmt = pg_insert(revocations).values(kind=c.kind, key=c.key, not_before=c.not_before)
        stmt = stmt.on_conflict_do_update(
            index_elements=["kind", "key"],
            set_={
                "not_before": func.greatest(revocations.c.not_before, stmt.excluded.not_before),
                "updated_at": func.clock_timestamp(),
            },
        )
        await session.execute(stmt)
    deny = session.info.get(INFO_KEY)
    if isinstance(deny, DenyList) and changes:

        def apply_after_commit(_session: Session) -> None:
            deny.apply(changes)

        event.listen(session.sync_session, "after_commit", apply_after_commit, once=True)


@subscriptions.on(
    ev.SessionRevoked,
    ev.UserUpdated,
    ev.ServiceAccountUpdated,
    ev.ServiceAccountDisabled,
    ev.ServiceAccountSecretRotated,
    ev.MembershipChanged,
    ev.MembershipRevoked,
    ev.ProjectUpdated,
    ev.TenantUpdated,
)
async def _on_identity_event(session: AsyncSession, e: ev.Event) -> None:
    await record(session, changes_of(e))


async def apply_locally(session: AsyncSession, e: ev.Event) -> None:
    """Identity, in the transaction that emits the event: its own tokens are refused once it commits."""
    await record(session, changes_of(e))


# --- long-lived streams ---


async def until_access_lost(
    deny: DenyList,
    principal: Principal,
    recheck: Callable[[], Awaitable[None]],
    *,
    keys: Iterable[uuid.UUID | None] = (),
    recheck_every_s: float = STREAM_RECHECK_S,
) -> Problem:
    """Wait until the stream's viewer may no longer see it and return why: the token revoked or expired
    (401), or `recheck` (the stream's own authorization against the IAM projection) raising. Re-checks on
    every change naming the viewer, its session or one of `keys`, at the token's expiry, and on a timer."""
    with deny.watching([principal.subject, principal.session_id, *keys]) as changed:
        while True:
            try:
                deny.check(principal)
                if principal.expires_at is not None and time.time() >= principal.expires_at:
                    raise Unauthorized("the access token has expired", code="token_expired")
                await recheck()
            except Problem as exc:
                return exc
            timeout = recheck_every_s
            if principal.expires_at is not None:
                timeout = max(0.0, min(timeout, principal.expires_at - time.time()))
            with suppress(TimeoutError):
                async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancel on 3.11
                    await changed.wait()
            changed.clear()


async def guarded(source: AsyncIterator[T], lost: Awaitable[Problem], last: Callable[[Problem], T]) -> AsyncIterator[T]:
    """`source`'s items until `lost` resolves; then `last(problem)` as the final item and the end."""
    watcher = asyncio.ensure_future(lost)
    try:
        while True:
            item = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({item, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if item not in done:
                item.cancel()
                with suppress(BaseException):
                    await item
                yield last(watcher.result())
                return
            try:
                value = item.result()
            except StopAsyncIteration:
                return
            yield value
    finally:
        watcher.cancel()
        with suppress(BaseException):
            await watcher
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            with suppress(BaseException):
                await aclose()


def sse_refusal(problem: Problem) -> dict[str, str]:
    """The last event of a stream closed for lost access (`event: access_revoked`, problem JSON): the
    client knows not to reconnect with the same token."""
    body = problem_body(problem.status, problem.code, problem.title, problem.detail)
    return {"event": "access_revoked", "data": json.dumps(body)}


def websocket_close_code(problem: Problem) -> int:
    """4401 / 4403 / 4404, as the WebSocket endpoints close for a refused handshake."""
    if isinstance(problem, Unauthorized):
        return 4401
    if isinstance(problem, NotFound):
        return 4404
    if isinstance(problem, Forbidden):
        return 4403
    return 4400 + problem.status % 100 if 400 <= problem.status < 500 else 4403
