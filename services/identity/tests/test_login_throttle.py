"""Brute-force protection per source address: `source_threshold` failed logins from one address refuse
every further login from it (429 `too_many_attempts`, even with the right password, for any account)
until its window runs out, while other addresses are not affected.

The HTTP tests run their own identity (a low `source_threshold`, an account lockout out of reach) and
name the caller's address with X-Forwarded-For (the test client's peer, 127.0.0.1, is a trusted proxy).
The window tests pass the time the throttle decides at (the use cases' injectable `clock`) instead
of sleeping.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timedelta

import httpx
import pytest

from gpuaas.identity.app import SPEC
from gpuaas.identity.credentials import Client, now
from gpuaas.identity.service import logins, throttle
from gpuaas.identity.settings import Settings
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.errors import TooManyRequests
from gpuaas.kit.testing import running, service_app

from .conftest import ADMIN_EMAIL, ADMIN_PASSWORD, ISSUER

SOURCE_THRESHOLD = 3
WINDOW_S = 900


@dataclass
class Throttled:
    client: httpx.AsyncClient
    kit: KitRuntime

    @property
    def settings(self) -> Settings:
        return self.kit.settings_as(Settings)

    async def login(self, email: str, password: str, ip: str) -> httpx.Response:
        return await self.client.post(
            "/auth/token",
            data={"grant_type": "password", "username": email, "password": password},
            headers={"X-Forwarded-For": f"10.9.9.9, {ip}"},  # the last hop is the caller
        )


@pytest.fixture(scope="module")
async def throttled(infra) -> AsyncIterator[Throttled]:
    app = await service_app(
        SPEC,
        infra.admin_url,
        infra.kafka_bootstrap,
        public_url=ISSUER,
        bootstrap_admin_email=ADMIN_EMAIL,
        bootstrap_admin_password=ADMIN_PASSWORD,
        source_threshold=SOURCE_THRESHOLD,
        lockout_threshold=1000,  # only the per-address limit is in play here
        lockout_window_s=WINDOW_S,
    )
    async with running(app) as (client, kit):
        yield Throttled(client, kit)


def address() -> str:
    """An address of its own for each test (the throttle's counts outlive a test)."""
    n = uuid.uuid4().int
    return f"203.0.{n % 250}.{(n >> 8) % 250 + 1}"


async def test_failures_from_one_address_throttle_it_and_not_another(throttled: Throttled) -> None:
    attacker, other = address(), address()
    for i in range(SOURCE_THRESHOLD):  # a different (unknown) account each time: no account lockout
        r = await throttled.login(f"nobody-{i}-{uuid.uuid4().hex[:6]}@example.com", "wrong password!", attacker)
        assert r.status_code == 401 and r.json()["code"] == "invalid_credentials", r.text

    # The address is throttled: even the right password of a real account is refused from it...
    r = await throttled.login(ADMIN_EMAIL, ADMIN_PASSWORD, attacker)
    assert r.status_code == 429 and r.json()["code"] == "too_many_attempts", r.text
    # ...and so is a service account's client_credentials grant.
    r = await throttled.client.post(
        "/auth/token",
        data={"grant_type": "client_credentials", "client_id": str(uuid.uuid4()), "client_secret": "x"},
        headers={"X-Forwarded-For": attacker},
    )
    assert r.status_code == 429 and r.json()["code"] == "too_many_attempts", r.text

    # Another address is not: the same account signs in, and a wrong password is a plain 401.
    r = await throttled.login(ADMIN_EMAIL, ADMIN_PASSWORD, other)
    assert r.status_code == 200 and r.json()["access_token"], r.text
    r = await throttled.login(f"nobody-{uuid.uuid4().hex[:6]}@example.com", "wrong password!", other)
    assert r.status_code == 401 and r.json()["code"] == "invalid_credentials", r.text


async def test_below_the_threshold_an_address_is_not_throttled(throttled: Throttled) -> None:
    ip = address()
    for _ in range(SOURCE_THRESHOLD - 1):
        r = await throttled.login(f"nobody-{uuid.uuid4().hex[:6]}@example.com", "wrong password!", ip)
        assert r.status_code == 401, r.text
    r = await throttled.login(ADMIN_EMAIL, ADMIN_PASSWORD, ip)
    assert r.status_code == 200, r.text


async def test_the_address_is_free_again_when_its_window_runs_out(throttled: Throttled) -> None:
    """The same sequence at explicit times: throttled inside the window, free after it (no sleeping)."""
    ip, settings = address(), throttled.settings
    t0 = now()
    for i in range(SOURCE_THRESHOLD):
        await throttle.record_failure(
            throttled.kit.sessions, settings, account=f"x{i}@example.com", ip=ip, at=t0 + timedelta(seconds=i)
        )

    async def check(at: datetime, source: str = ip) -> None:
        async with throttled.kit.sessions() as session:
            await throttle.check(session, settings, account=ADMIN_EMAIL, ip=source, at=at)

    with pytest.raises(TooManyRequests):
        await check(t0 + timedelta(seconds=WINDOW_S - 1))
    await check(t0 + timedelta(seconds=1), source=address())  # another address: free
    await check(t0 + timedelta(seconds=WINDOW_S + 1))  # the window has run out

    # Through the login use case with its clock injected: refused now, signed in after the window.
    with pytest.raises(TooManyRequests):
        await logins.password_login(
            throttled.kit.sessions,
            settings,
            email=ADMIN_EMAIL,
            password=ADMIN_PASSWORD,
            client=Client(ip=ip),
            clock=lambda: t0 + timedelta(seconds=60),
        )
    grant = await logins.password_login(
        throttled.kit.sessions,
        settings,
        email=ADMIN_EMAIL,
        password=ADMIN_PASSWORD,
        client=Client(ip=ip),
        clock=lambda: t0 + timedelta(seconds=WINDOW_S + 1),
    )
    assert grant.access_token

    # A failure after the window starts a new count: one failure is below the threshold again.
    later = t0 + timedelta(seconds=WINDOW_S + 2)
    await throttle.record_failure(throttled.kit.sessions, settings, account="y@example.com", ip=ip, at=later)
    await check(later + timedelta(seconds=1))


async def test_a_throttled_address_does_not_lock_out_an_account_used_from_it(throttled: Throttled) -> None:
    """Issue 28: 55 failed logins for unknown emails from the devstack's one address (everyone is 127.0.0.1
    there) made the operator's own login answer 429. An account that signed in from the address before is
    exempt from the address's throttle; an account never seen from it is still refused."""
    ip, settings = address(), throttled.settings
    t0 = now()

    async def login(at: datetime, email: str = ADMIN_EMAIL, password: str = ADMIN_PASSWORD) -> None:
        await logins.password_login(
            throttled.kit.sessions, settings, email=email, password=password, client=Client(ip=ip), clock=lambda: at
        )

    await login(t0)  # the operator uses this address
    for i in range(SOURCE_THRESHOLD + 2):  # then someone there sprays unknown emails
        await throttle.record_failure(
            throttled.kit.sessions, settings, account=f"spray{i}@example.com", ip=ip, at=t0 + timedelta(seconds=i)
        )
    with pytest.raises(TooManyRequests) as refused:
        async with throttled.kit.sessions() as session:
            await throttle.check(session, settings, account="new@example.com", ip=ip, at=t0 + timedelta(seconds=30))
    assert refused.value.code == "too_many_attempts"
    await login(t0 + timedelta(seconds=30))  # the operator is not locked out
    # Once the account has not been used from there for known_source_ttl_s, it is throttled like any other.
    late = t0 + timedelta(seconds=settings.known_source_ttl_s + 31)
    for i in range(SOURCE_THRESHOLD):
        await throttle.record_failure(throttled.kit.sessions, settings, account=f"late{i}@example.com", ip=ip, at=late)
    with pytest.raises(TooManyRequests):
        await login(late + timedelta(seconds=1))


async def test_each_backoff_of_an_account_from_an_address_doubles(throttled: Throttled) -> None:
    """The per-(account, source) backoff grows: lockout_s, then twice that, capped at lockout_max_s; the
    same account from another address is never backed off."""
    settings = throttled.settings.model_copy(
        update={"lockout_threshold": 2, "lockout_s": 60, "lockout_max_s": 200, "source_threshold": 1000}
    )
    ip, account = address(), f"victim-{uuid.uuid4().hex[:6]}@example.com"
    t = now()

    async def fail_twice(at: datetime) -> None:
        for _ in range(2):
            await throttle.record_failure(throttled.kit.sessions, settings, account=account, ip=ip, at=at)

    async def backed_off(at: datetime, source: str = ip) -> bool:
        async with throttled.kit.sessions() as session:
            try:
                await throttle.check(session, settings, account=account, ip=source, at=at)
            except TooManyRequests as exc:
                assert exc.code == "login_backoff"
                return True
        return False

    for length in (60, 120, 200, 200):
        await fail_twice(t)
        assert await backed_off(t + timedelta(seconds=length - 2)), length
        assert not await backed_off(t + timedelta(seconds=1), source=address())
        t += timedelta(seconds=length + 1)
        assert not await backed_off(t), length
