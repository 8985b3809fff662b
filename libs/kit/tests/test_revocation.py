"""gpuaas.kit.revocation: the deny list (hot-path check, event -> rows, replicas kept in step through the
table) and the watch that ends streams."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from gpuaas.contracts import ActorKind
from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.events import identity as ev
from gpuaas.kit import revocation
from gpuaas.kit.auth import Principal
from gpuaas.kit.db import create_engine, session_factory
from gpuaas.kit.errors import Forbidden, Unauthorized
from gpuaas.kit.revocation import ACCESS, SESSION, SUBJECT, Change, DenyList
from gpuaas.kit.testing import new_service_db


def principal(sub: uuid.UUID, *, sid: uuid.UUID | None = None, iat: float | None = None, exp: float | None = None):
    now = time.time()
    return Principal(
        subject=sub,
        kind=ActorKind.user,
        session_id=sid,
        issued_at=int(now) if iat is None else iat,
        expires_at=now + 300 if exp is None else exp,
    )


def test_revoked_session_is_refused_and_others_are_not() -> None:
    deny, user, sid, other = DenyList(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    deny.check(principal(user, sid=sid))
    deny.apply([Change(SESSION, sid)])
    with pytest.raises(Unauthorized) as exc:
        deny.check(principal(user, sid=sid))
    assert exc.value.code == "session_revoked" and exc.value.status == 401
    deny.check(principal(user, sid=other))  # the user's other session still works


def test_subject_not_before_refuses_older_tokens_only() -> None:
    deny, user = DenyList(), uuid.uuid4()
    t = datetime(2026, 11, 24, 12, 0, 0, 500000, tzinfo=UTC)
    deny.apply([Change(SUBJECT, user, t)])
    for iat in (t.timestamp() - 60, float(int(t.timestamp()))):  # before, and the same second (conservative)
        with pytest.raises(Unauthorized) as exc:
            deny.check(principal(user, iat=iat))
        assert exc.value.code == "token_revoked"
    deny.check(principal(user, iat=t.timestamp() + 1))  # issued after (a re-enabled account signed in again)
    deny.apply([Change(SUBJECT, user, t - timedelta(hours=1))])  # an older event replayed: the later one wins
    with pytest.raises(Unauthorized):
        deny.check(principal(user, iat=t.timestamp() - 60))


def test_access_changes_deny_nothing_but_wake_watchers() -> None:
    deny, user, project = DenyList(), uuid.uuid4(), uuid.uuid4()
    with deny.watching([user]) as mine, deny.watching([project]) as theirs:
        deny.apply([Change(ACCESS, user)])
        deny.check(principal(user))
        assert mine.is_set() and not theirs.is_set()
    assert not deny._watchers  # unregistered on exit


def test_events_map_to_changes() -> None:
    user, sid, sa = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    s = ev.SessionState(session_id=sid, user_id=user, revoked=True, revoked_reason="logout")
    assert revocation.changes_of(ev.SessionRevoked.build(subject=sid, data=s, source="identity")) == [
        Change(SESSION, sid),
        Change(ACCESS, user),
    ]
    u = ev.UserState(user_id=user, email="a@b.example", status="disabled")
    disabled = ev.UserUpdated.build(subject=user, data=u, source="identity")
    assert revocation.changes_of(disabled) == [Change(SUBJECT, user, disabled.time)]
    state = {"service_account_id": sa, "tenant_id": uuid.uuid4(), "project_id": uuid.uuid4(), "name": "c"}
    rot = ev.ServiceAccountSecretRotated.build(subject=sa, data=ev.ServiceAccountState(**state), source="identity")
    assert revocation.changes_of(rot) == [Change(SUBJECT, sa, rot.time)]
    plain = ev.ServiceAccountUpdated.build(subject=sa, data=ev.ServiceAccountState(**state), source="identity")
    assert revocation.changes_of(plain) == [Change(ACCESS, sa)]
    m = ev.MembershipState(
        membership_id=uuid.uuid4(), user_id=user, scope=MembershipScope.tenant, role=Role.viewer, revoked=True
    )
    assert revocation.changes_of(ev.MembershipRevoked.build(subject=m.membership_id, data=m, source="identity")) == [
        Change(ACCESS, user)
    ]


async def test_stream_watch_returns_on_revocation_on_recheck_failure_and_at_expiry() -> None:
    deny, user, sid = DenyList(), uuid.uuid4(), uuid.uuid4()
    allowed = True
    checked = asyncio.Event()  # the watch ran a check (and found access still there, while allowed)

    async def recheck() -> None:
        checked.set()
        if not allowed:
            raise Forbidden("gone", code="permission_denied")

    watch = asyncio.create_task(revocation.until_access_lost(deny, principal(user, sid=sid), recheck))
    await asyncio.wait_for(checked.wait(), 5)
    assert not watch.done()  # the first check passed: the watch waits for a change
    deny.apply([Change(SESSION, sid)])
    assert (await asyncio.wait_for(watch, 1)).code == "session_revoked"

    checked.clear()
    watch = asyncio.create_task(revocation.until_access_lost(deny, principal(user), recheck))
    await asyncio.wait_for(checked.wait(), 5)  # its first check found access: only the change below ends it
    assert not watch.done()
    allowed = False
    deny.apply([Change(ACCESS, user)])  # a membership change: the recheck decides
    assert (await asyncio.wait_for(watch, 1)).code == "permission_denied"

    allowed = True
    t0 = time.monotonic()
    lost = await asyncio.wait_for(
        revocation.until_access_lost(deny, principal(user, exp=time.time() + 0.3), recheck), 2
    )
    assert lost.code == "token_expired" and time.monotonic() - t0 < 1.5


async def test_guarded_stream_ends_with_the_refusal() -> None:
    async def ticks() -> AsyncIterator[int]:
        n = 0
        while True:
            yield n
            n += 1
            await asyncio.sleep(0.01)

    gate: asyncio.Future[Forbidden] = asyncio.get_running_loop().create_future()
    seen: list[object] = []

    async def read() -> None:
        async for item in revocation.guarded(ticks(), gate, lambda p: p.code):
            seen.append(item)

    reader = asyncio.create_task(read())

    async def three_items() -> None:
        while len(seen) < 3:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(three_items(), 5)  # the stream flows until the gate resolves
    assert not reader.done()
    gate.set_result(Forbidden("x", code="membership_gone"))
    await asyncio.wait_for(reader, 1)
    assert seen[-1] == "membership_gone" and seen[:-1] == list(range(len(seen) - 1)) and len(seen) > 3


@pytest.mark.integration
async def test_rows_persist_and_reach_every_replica(infra) -> None:
    name, url = await new_service_db(infra.admin_url, "revocations")
    engine = create_engine(url, name)
    consuming, other = DenyList(), DenyList()
    sessions = session_factory(engine, info={revocation.INFO_KEY: consuming})
    user, sid = uuid.uuid4(), uuid.uuid4()
    try:
        await other.poll(sessions, 3600)  # the other replica has loaded (nothing yet)
        s = ev.SessionState(session_id=sid, user_id=user, revoked=True, revoked_reason="logout")
        async with sessions() as session, session.begin():
            await revocation.apply_locally(session, ev.SessionRevoked.build(subject=sid, data=s, source="identity"))
            assert sid not in consuming.sessions  # not before the transaction commits
        assert sid in consuming.sessions  # the consuming process: at commit
        assert await other.poll(sessions, 3600) == 2  # the other replica: at its next poll
        with pytest.raises(Unauthorized):
            other.check(principal(user, sid=sid))
        assert await other.poll(sessions, 3600) == 0  # nothing applied twice
        restarted = DenyList()  # a restart loads the table
        await restarted.poll(sessions, 3600)
        with pytest.raises(Unauthorized):
            restarted.check(principal(user, sid=sid))
    finally:
        await engine.dispose()
