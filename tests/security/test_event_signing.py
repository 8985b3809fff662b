"""Issue 17, defect 8: events that grant access are accepted only from their owner, in their owner's order.

- A forged identity event granting `platform_admin` (unsigned, signed by another service, signed by an
  unknown key, or a genuine signature over altered content) is dead-lettered by every consuming service
  and grants nothing; a genuine signed grant published after it is applied by all of them.
- A clock step on identity's side cannot drop a revoke: the projection orders by the envelope `sequence`
  identity's outbox stamps, not by event time.

Real Postgres and a real broker (the session's `infra`); every consuming service runs in-process.
Kafka ACLs (the transport half of the defect) are exercised on Apache Kafka in test_kafka_acls.py.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from sqlalchemy import select

from gpuaas.allocations.app import SPEC as ALLOCATIONS
from gpuaas.app_runtime.app import SPEC as APP_RUNTIME
from gpuaas.billing.app import SPEC as BILLING
from gpuaas.catalog.app import SPEC as CATALOG
from gpuaas.contracts import ActorKind
from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.events import identity as ev
from gpuaas.contracts.registry import IDENTITY
from gpuaas.kit import iam
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.auth import Principal
from gpuaas.kit.event_signing import EventSigner, generate_seed
from gpuaas.kit.outbox import add_events
from gpuaas.kit.tables import dead_letters, iam_memberships
from gpuaas.kit.testing import build, event_signer_of, new_service_db, running, service_app, wait_for
from gpuaas.kit.testing_events import platform_admin, publish
from gpuaas.metering.app import SPEC as METERING

CONSUMING = (ALLOCATIONS, CATALOG, APP_RUNTIME, METERING, BILLING)


@pytest.fixture(scope="module")
async def consumers(infra: Any) -> AsyncIterator[dict[str, KitRuntime]]:
    """Every service that consumes the identity topic, running on its own schema and consumer group."""
    async with AsyncExitStack() as stack:
        kits: dict[str, KitRuntime] = {}
        for spec in CONSUMING:
            app = await service_app(spec, infra.admin_url, infra.kafka_bootstrap)
            _, kit = await stack.enter_async_context(running(app))
            kits[spec.name] = kit
        yield kits


def admin_principal(user_id: uuid.UUID) -> Principal:
    return Principal(subject=user_id, kind=ActorKind.user)


async def membership(kit: KitRuntime, user_id: uuid.UUID) -> Any:
    async with kit.sessions() as session:
        return (await session.execute(select(iam_memberships).where(iam_memberships.c.user_id == user_id))).first()


async def is_admin(kit: KitRuntime, user_id: uuid.UUID) -> bool:
    async with kit.sessions() as session:
        return await iam.is_platform_admin(session, admin_principal(user_id))


async def put_raw(bootstrap: str, payloads: list[tuple[bytes, bytes]]) -> None:
    """Write to the identity topic as anyone with write access could (no outbox, no relay)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for key, value in payloads:
            await (await producer.send(IDENTITY, value, key=key))
    finally:
        await producer.stop()


async def test_forged_identity_events_are_refused_by_every_consumer(
    infra: Any, consumers: dict[str, KitRuntime]
) -> None:
    forged = {name: platform_admin(uuid.uuid4()) for name in ("unsigned", "other_service", "unknown_key", "altered")}
    genuine = platform_admin(uuid.uuid4())

    def body(event: ev.Event) -> bytes:
        return event.model_dump_json().encode()

    altered = json.loads(event_signer_of("identity").sign_payload(body(platform_admin(uuid.uuid4()))))
    altered["data"]["user_id"] = str(forged["altered"].data.user_id)  # a genuine signature, other content
    altered["id"], altered["subject"] = str(forged["altered"].id), str(forged["altered"].subject)
    await put_raw(
        infra.kafka_bootstrap,
        [
            (forged["unsigned"].key(), body(forged["unsigned"])),
            (forged["other_service"].key(), event_signer_of("allocations").sign_payload(body(forged["other_service"]))),
            (forged["unknown_key"].key(), EventSigner(generate_seed()).sign_payload(body(forged["unknown_key"]))),
            (forged["altered"].key(), json.dumps(altered).encode()),
        ],
    )
    await publish(infra.kafka_bootstrap, [genuine])  # signed by identity's key, as its relay signs

    async def every_forgery_parked(kit: KitRuntime) -> list[Any] | None:
        async with kit.sessions() as session:
            rows = await session.execute(
                select(dead_letters.c.event_id, dead_letters.c.error).where(
                    dead_letters.c.event_id.in_([e.id for e in forged.values()])
                )
            )
        parked = list(rows.all())
        return parked if len(parked) == len(forged) else None

    for name, kit in consumers.items():
        await wait_for(lambda k=kit: is_admin(k, genuine.data.user_id), 60, f"{name} applying the genuine grant")
        # The forgeries have their own keys, so they may sit on other partitions: wait until each was handled.
        rows = await wait_for(lambda k=kit: every_forgery_parked(k), 60, f"{name} parking every forgery")
        assert {r.event_id for r in rows} == {e.id for e in forged.values()}, name
        assert all(r.error.startswith("rejected:") for r in rows), rows
        for how, event in forged.items():
            assert not await is_admin(kit, event.data.user_id), f"{name} accepted the {how} forgery"
            assert await membership(kit, event.data.user_id) is None


async def test_a_clock_stepped_revoke_still_wins(infra: Any, consumers: dict[str, KitRuntime]) -> None:
    """identity grants, then its clock steps back an hour and it revokes: the revoke's event time is
    earlier than the grant's. Ordered by time (as before) the revoke was dropped; ordered by the outbox
    sequence it wins, on identity's own projection and on every consumer."""
    schema, url = await new_service_db(infra.admin_url, "sec_identity_clock", None)
    producer = build("identity", url, infra.kafka_bootstrap, settings={"db_schema": schema})
    user, tenant = uuid.uuid4(), uuid.uuid4()
    state = ev.MembershipState(
        membership_id=uuid.uuid4(), user_id=user, scope=MembershipScope.tenant, role=Role.tenant_admin, tenant_id=tenant
    )
    now = datetime.now(UTC)
    grant = ev.MembershipGranted.build(data=state, source="identity", time=now)
    revoked_state = state.model_copy(update={"revoked": True})
    revoke = ev.MembershipRevoked.build(data=revoked_state, source="identity", time=now - timedelta(hours=1))
    async with running(producer, wait_consumer=False) as (_, kit):
        for event in (grant, revoke):  # two transactions, in this order, as identity's use cases run
            async with kit.sessions() as session, session.begin():
                await add_events(session, [event])
                await iam.apply_locally(session, event)
        assert grant.sequence is not None and revoke.sequence is not None and revoke.sequence > grant.sequence
        assert revoke.time < grant.time  # the clock step
        local = await membership(kit, user)
        assert local.revoked and local.version == revoke.sequence
        for name, consumer in consumers.items():

            async def revoked(k: KitRuntime = consumer) -> bool:
                row = await membership(k, user)
                return row is not None and row.version == revoke.sequence

            await wait_for(revoked, 60, f"{name} applying the revoke")
            row = await membership(consumer, user)
            assert row.revoked, f"{name}: the clock-stepped revoke was dropped"


async def test_an_older_sequence_never_overwrites_a_newer_one(consumers: dict[str, KitRuntime]) -> None:
    """Out of order (a replay, a stale copy with a later clock): the higher sequence stays."""
    kit = consumers["allocations"]
    user = uuid.uuid4()
    state = ev.MembershipState(
        membership_id=uuid.uuid4(), user_id=user, scope=MembershipScope.platform, role=Role.platform_admin
    )
    later_clock = datetime.now(UTC) + timedelta(hours=2)
    revoke = ev.MembershipRevoked.build(data=state.model_copy(update={"revoked": True}), source="identity", sequence=7)
    stale_grant = ev.MembershipGranted.build(data=state, source="identity", sequence=6, time=later_clock)
    unsequenced = ev.MembershipGranted.build(data=state, source="identity", time=later_clock)  # pre-upgrade event
    async with kit.sessions() as session, session.begin():
        for event in (revoke, stale_grant, unsequenced):
            await iam.apply_locally(session, event)
    row = await membership(kit, user)
    assert row.revoked and row.version == 7
    assert not await is_admin(kit, user)
