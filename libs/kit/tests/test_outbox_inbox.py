"""Outbox → broker → inbox on the real Postgres and the real broker: exactly-once effects,
per-aggregate order, dead letters, malformed messages, single relay leader."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import AIOKafkaProducer
from sqlalchemy import text

from gpuaas.contracts import Actor
from gpuaas.contracts.events.audit import AuditRecord, AuditRecorded
from gpuaas.contracts.registry import AUDIT
from gpuaas.kit.db import create_engine, session_factory, to_plain_url
from gpuaas.kit.metrics import ServiceMetrics
from gpuaas.kit.outbox import add_events
from gpuaas.kit.relay import OutboxRelay, replay
from gpuaas.kit.subscriptions import Subscriptions
from gpuaas.kit.testing import build, new_service_db, running, wait_for

pytestmark = pytest.mark.integration


def audit_event(run: str, subject: str, seq: int, reason: str = "") -> AuditRecorded:
    return AuditRecorded.build(
        subject=subject,
        source="test",
        actor=Actor.system("test"),
        data=AuditRecord(
            service=run,
            action="test.write",
            resource_type="thing",
            resource_id=subject,
            after={"seq": seq},
            reason=reason,
        ),
    )


def counting_handlers(run: str, poison: set[str] | None = None) -> Subscriptions:
    """Records every application of this run's events in `applied` (no unique key: duplicates would show)."""
    subs = Subscriptions()

    @subs.on(AuditRecorded)
    async def apply(session, event: AuditRecorded) -> None:
        if event.data.service != run:
            return
        if poison is not None and event.data.reason in poison:
            raise RuntimeError(f"poisoned: {event.data.reason}")
        await session.execute(
            text("INSERT INTO applied (event_id, subject, seq) VALUES (:e, :s, :q)"),
            {"e": event.id, "s": event.subject, "q": event.data.after["seq"]},
        )

    return subs


async def make_applied_table(url: str, schema: str) -> None:
    engine = create_engine(url, schema)
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE applied (n bigserial primary key, event_id uuid, subject text, seq int)"))
    await engine.dispose()


async def fetch(url: str, schema: str, sql: str) -> list:
    engine = create_engine(url, schema)
    async with engine.connect() as conn:
        rows = (await conn.execute(text(sql))).all()
    await engine.dispose()
    return rows


async def test_events_apply_exactly_once_in_order_and_survive_replay(infra) -> None:
    run = uuid.uuid4().hex
    prod_name, prod_url = await new_service_db(infra.admin_url, "prod")
    cons_name, cons_url = await new_service_db(infra.admin_url, "cons")
    await make_applied_table(cons_url, cons_name)
    producer = build(prod_name, prod_url, infra.kafka_bootstrap, with_iam=False)
    consumer = build(cons_name, cons_url, infra.kafka_bootstrap, with_iam=False, subscriptions=counting_handlers(run))
    subjects = [f"agg-{i}" for i in range(10)]
    n_per_subject = 30
    async with running(producer) as (_, pkit), running(consumer) as (_, ckit):
        # Many transactions, interleaving aggregates: 300 events.
        for seq in range(n_per_subject):
            async with pkit.sessions() as s, s.begin():
                await add_events(s, [audit_event(run, subj, seq) for subj in subjects])
        total = len(subjects) * n_per_subject

        async def applied() -> int:
            return (await fetch(cons_url, cons_name, "SELECT count(*) FROM applied"))[0][0]

        await wait_for(lambda: _eq(applied(), total), 60, "all events applied")

        # Replay everything: the relay publishes all 300 again; the inbox must swallow them.
        requeued = await replay(pkit.sessions, since=_epoch())
        assert requeued == total
        await wait_for(lambda: _counter(ckit, "events_duplicate", AUDIT, total), 60, "duplicates seen")
        assert await applied() == total

    rows = await fetch(cons_url, cons_name, "SELECT subject, seq FROM applied ORDER BY n")
    assert len({(s, q) for s, q in rows}) == total, "an event was applied twice"
    for subj in subjects:
        seqs = [q for s, q in rows if s == subj]
        assert seqs == sorted(seqs), f"events of {subj} applied out of order"


async def test_failing_handler_is_dead_lettered_then_retried(infra, signer) -> None:
    from .test_iam import operator_events

    run = uuid.uuid4().hex
    prod_name, prod_url = await new_service_db(infra.admin_url, "prod")
    cons_name, cons_url = await new_service_db(infra.admin_url, "cons")
    await make_applied_table(cons_url, cons_name)
    poison = {"poison"}
    producer = build(prod_name, prod_url, infra.kafka_bootstrap, with_iam=False)
    consumer = build(
        cons_name,
        cons_url,
        infra.kafka_bootstrap,
        subscriptions=counting_handlers(run, poison),
        settings={"consumer_max_attempts": 3},
    )
    admin_id = uuid.uuid4()
    async with running(producer) as (_, pkit), running(consumer, jwks=signer.jwks) as (client, ckit):
        from gpuaas.kit.iam import apply_locally

        async with ckit.sessions() as s, s.begin():
            for e in operator_events(admin_id):
                await apply_locally(s, e)
        async with pkit.sessions() as s, s.begin():
            await add_events(
                s, [audit_event(run, "a", 0), audit_event(run, "b", 1, reason="poison"), audit_event(run, "c", 2)]
            )
        auth = {"Authorization": f"Bearer {signer.token(admin_id)}"}

        async def parked() -> list:
            r = await client.get("/admin/dead-letters", headers=auth)
            assert r.status_code == 200, r.text
            return r.json()["items"]

        await wait_for(lambda: _len(parked(), 1), 60, "dead letter")
        dead = (await parked())[0]
        assert dead["attempts"] == 3 and "poisoned" in dead["error"] and dead["event_type"] == "audit.recorded"
        rows = await fetch(cons_url, cons_name, "SELECT seq FROM applied ORDER BY seq")
        assert [r[0] for r in rows] == [0, 2], "the batch must go on past a poisoned event"

        # Still failing: the retry reports it and keeps the letter parked.
        r = await client.post(f"/admin/dead-letters/{dead['id']}/retry", headers=auth)
        assert r.status_code == 409 and r.json()["code"] == "dead_letter_retry_failed"
        poison.clear()  # the "fix" is deployed
        r = await client.post(f"/admin/dead-letters/{dead['id']}/retry", headers=auth)
        assert r.status_code == 200 and r.json()["status"] == "resolved"
        assert await parked() == []
        rows = await fetch(cons_url, cons_name, "SELECT seq FROM applied ORDER BY seq")
        assert [r[0] for r in rows] == [0, 1, 2]
        # A stranger (no operator membership) may not touch the admin surface.
        r = await client.get("/admin/dead-letters", headers={"Authorization": f"Bearer {signer.token(uuid.uuid4())}"})
        assert r.status_code == 403 and r.headers["content-type"].startswith("application/problem+json")


async def test_malformed_messages_are_parked_and_never_stop_the_consumer(infra) -> None:
    run = uuid.uuid4().hex
    cons_name, cons_url = await new_service_db(infra.admin_url, "cons")
    await make_applied_table(cons_url, cons_name)
    consumer = build(cons_name, cons_url, infra.kafka_bootstrap, with_iam=False, subscriptions=counting_handlers(run))
    async with running(consumer):
        raw = AIOKafkaProducer(bootstrap_servers=infra.kafka_bootstrap)
        await raw.start()
        try:
            marker = f"garbage-{run}".encode()
            await raw.send_and_wait(AUDIT, b"{not json " + marker, key=b"x")
            bad_shape = b'{"type": "audit.recorded", "id": "nope", "marker": "' + marker + b'"}'
            await raw.send_and_wait(AUDIT, bad_shape, key=b"y")
            # Nesting deeper than the JSON decoder's recursion limit (RecursionError, not ValueError).
            deep = b'{"marker": "' + marker + b'", "data": ' + b"[" * 5000 + b"]" * 5000 + b"}"
            await raw.send_and_wait(AUDIT, deep, key=b"x")
            await raw.send_and_wait(AUDIT, b'{"type": "some.future.event", "data": {}}', key=b"z")
            await raw.send_and_wait(AUDIT, audit_event(run, "ok", 7).model_dump_json().encode(), key=b"ok")
        finally:
            await raw.stop()

        async def done() -> bool:
            return (await fetch(cons_url, cons_name, "SELECT count(*) FROM applied"))[0][0] == 1

        await wait_for(done, 60, "valid event applied after garbage")
    parked = await fetch(cons_url, cons_name, "SELECT error, payload FROM dead_letters")
    ours = [p for p in parked if marker in bytes(p[1])]
    assert len(ours) == 3 and all(p[0].startswith("malformed event") for p in ours)
    # The unknown event type is ignored, not parked.
    assert not [p for p in parked if b"some.future.event" in bytes(p[1])]


@pytest.mark.parametrize("failure", ["crash", "internal_cancel", "client_stopped"])
async def test_consumer_task_survives_its_client_failing(infra, failure: str) -> None:
    """Whatever ends the poll loop (a bug, aiokafka cancelling a future it owns, the client stopped under us),
    the consumer reports not-ready, builds a new client and goes on applying: it never dies with a stale
    assignment that still reads as ready (what wedged a service's consumer after a broker outage)."""
    run = uuid.uuid4().hex
    prod_name, prod_url = await new_service_db(infra.admin_url, "prod")
    cons_name, cons_url = await new_service_db(infra.admin_url, "cons")
    await make_applied_table(cons_url, cons_name)
    producer = build(prod_name, prod_url, infra.kafka_bootstrap, with_iam=False)
    consumer = build(cons_name, cons_url, infra.kafka_bootstrap, with_iam=False, subscriptions=counting_handlers(run))

    async def applied() -> int:
        return (await fetch(cons_url, cons_name, "SELECT count(*) FROM applied"))[0][0]

    async with running(producer) as (_, pkit), running(consumer) as (_, ckit):
        async with pkit.sessions() as s, s.begin():
            await add_events(s, [audit_event(run, "before", 0)])
        await wait_for(lambda: _eq(applied(), 1), 60, "first event applied")
        ec = ckit.consumer
        client = ec.consumer
        assert ec.assigned
        if failure == "client_stopped":
            await client.stop()
        else:
            real_getmany = client.getmany

            async def failing_getmany(*args, **kwargs):
                client.getmany = real_getmany  # once
                if failure == "crash":
                    raise RuntimeError("injected bug in the poll loop")
                raise asyncio.CancelledError()  # as aiokafka does when it cancels a waiter it owns

            client.getmany = failing_getmany
        await wait_for(lambda: ec.consumer is not client, 30, "a new client")
        assert ec.metrics.consumer_restarts._value.get() >= 1
        async with pkit.sessions() as s, s.begin():
            await add_events(s, [audit_event(run, "after", 1)])
        await wait_for(lambda: _eq(applied(), 2), 60, "event applied by the new client")
        await wait_for(lambda: ec.assigned, 30, "ready again")
        task = next(t for t in ckit.tasks if t.get_name() == "consumer")
        assert not task.done()


async def test_topic_prefix_isolates_deployments_on_one_broker(infra) -> None:
    """GPUAAS_KAFKA_TOPIC_PREFIX: two deployments on one cluster; each reads only its own events, while the
    outbox, the inbox and the handlers keep the registry's topic names."""
    run = uuid.uuid4().hex
    blue, green = f"blue{run[:8]}.", f"green{run[:8]}."
    prod_name, prod_url = await new_service_db(infra.admin_url, "prod")
    names = {}
    apps = {}
    for prefix in (blue, green):
        cons_name, cons_url = await new_service_db(infra.admin_url, "cons")
        await make_applied_table(cons_url, cons_name)
        names[prefix] = (cons_name, cons_url)
        apps[prefix] = build(
            cons_name,
            cons_url,
            infra.kafka_bootstrap,
            with_iam=False,
            subscriptions=counting_handlers(run),
            settings={"kafka_topic_prefix": prefix},
        )
    producer = build(prod_name, prod_url, infra.kafka_bootstrap, with_iam=False, settings={"kafka_topic_prefix": blue})

    async def applied(prefix: str) -> int:
        return (await fetch(names[prefix][1], names[prefix][0], "SELECT count(*) FROM applied"))[0][0]

    async with running(producer) as (_, pkit), running(apps[blue]) as (_, bkit), running(apps[green]) as (_, gkit):
        assert bkit.consumer.group_id == f"{blue}{names[blue][0]}"
        async with pkit.sessions() as s, s.begin():
            await add_events(s, [audit_event(run, "blue-only", i) for i in range(3)])
        await wait_for(lambda: _eq(applied(blue), 3), 60, "the blue deployment applies its events")
        await wait_for(lambda: gkit.consumer.assigned, 30, "green consumer assigned")
        assigned = {tp.topic for tp in gkit.consumer.consumer.assignment()}
        assert assigned and all(t.startswith(green) for t in assigned), f"green is assigned {assigned}"
        # A probe on green's own topic: once green has applied it, green is consuming, and still only it.
        await _publish_raw(infra.kafka_bootstrap, green + AUDIT, audit_event(run, "green-probe", 0))
        await wait_for(lambda: _eq(applied(green), 1), 60, "green applying its own probe")
        rows = await fetch(names[green][1], names[green][0], "SELECT subject FROM applied")
        assert [r for (r,) in rows] == ["green-probe"], "green read blue's events"
        outbox_topics = await fetch(prod_url, prod_name, "SELECT DISTINCT topic FROM outbox")
        assert [t for (t,) in outbox_topics] == [AUDIT], "the outbox keeps the logical topic name"
    inbox_topics = await fetch(names[blue][1], names[blue][0], "SELECT DISTINCT topic FROM inbox")
    assert [t for (t,) in inbox_topics] == [AUDIT], "the inbox records the logical topic name"


async def test_batch_handler_gets_neighbouring_events_in_one_call_and_is_isolated_on_failure(infra) -> None:
    """`Subscriptions.on_batch`: one call per run of fresh events (not one per event), in order; a failing
    event sends the batch through the one-event-at-a-time path, where only the poisoned event is parked."""
    run = uuid.uuid4().hex
    calls: list[int] = []
    subs = Subscriptions()

    @subs.on_batch(AuditRecorded)
    async def apply_many(session, events: list[AuditRecorded]) -> None:
        ours = [e for e in events if e.data.service == run]
        if not ours:
            return
        calls.append(len(ours))
        if any(e.data.reason == "poison" for e in ours):
            raise RuntimeError("poisoned")
        for e in ours:
            await session.execute(
                text("INSERT INTO applied (event_id, subject, seq) VALUES (:e, :s, :q)"),
                {"e": e.id, "s": e.subject, "q": e.data.after["seq"]},
            )

    with pytest.raises(ValueError):
        subs.on(AuditRecorded)(apply_many)  # a batch handler is its type's only handler
    prod_name, prod_url = await new_service_db(infra.admin_url, "prod")
    cons_name, cons_url = await new_service_db(infra.admin_url, "cons")
    await make_applied_table(cons_url, cons_name)
    producer = build(prod_name, prod_url, infra.kafka_bootstrap, with_iam=False)
    consumer = build(cons_name, cons_url, infra.kafka_bootstrap, with_iam=False, subscriptions=subs)

    async def applied() -> int:
        return (await fetch(cons_url, cons_name, "SELECT count(*) FROM applied"))[0][0]

    async with running(producer) as (_, pkit), running(consumer):
        async with pkit.sessions() as s, s.begin():  # one subject: one partition, one ordered run
            await add_events(s, [audit_event(run, "one-subject", i) for i in range(200)])
        await wait_for(lambda: _eq(applied(), 200), 60, "all applied")
        assert len(calls) < 200 and max(calls) > 1, f"batched calls expected, got {calls[:20]}"
        calls.clear()
        async with pkit.sessions() as s, s.begin():
            await add_events(
                s, [audit_event(run, "one-subject", 200 + i, reason="poison" if i == 3 else "") for i in range(6)]
            )
        await wait_for(lambda: _eq(applied(), 205), 60, "the five good events applied")
    rows = await fetch(cons_url, cons_name, "SELECT seq FROM applied ORDER BY n")
    assert [q for (q,) in rows] == [*range(203), 204, 205], "in order, the poisoned one left out"
    parked = await fetch(cons_url, cons_name, "SELECT error, payload FROM dead_letters")
    ours = [error for error, payload in parked if run.encode() in bytes(payload)]  # the topic is shared
    assert len(ours) == 1 and "poisoned" in ours[0]
    assert 1 in calls, "the isolation path called the batch handler one event at a time"


async def test_only_one_relay_leads_per_schema(infra) -> None:
    from gpuaas.kit.kafka import make_producer

    name, url = await new_service_db(infra.admin_url, "relay")
    engine = create_engine(url, name)
    producer = make_producer(infra.kafka_bootstrap, 1_000_000)
    await producer.start()
    relays = [
        OutboxRelay(
            schema=name,
            engine=engine,
            sessions=session_factory(engine),
            producer=producer,
            dsn=to_plain_url(url),
            metrics=ServiceMetrics(f"r{i}"),
            poll_interval_s=0.2,
        )
        for i in range(2)
    ]
    tasks = [asyncio.create_task(r.run()) for r in relays]
    try:
        await wait_for(lambda: any(r.is_leader for r in relays), 10, "a leader")
        await asyncio.sleep(1.0)
        assert sum(r.is_leader for r in relays) == 1
        leader = next(r for r in relays if r.is_leader)
        standby = next(r for r in relays if not r.is_leader)
        leader.stop()
        await wait_for(lambda: standby.is_leader, 15, "standby takes over")
    finally:
        for r in relays:
            r.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await producer.stop()
        await engine.dispose()


# --- helpers ---


async def _eq(value_coro, expected: int) -> bool:
    return (await value_coro) == expected


async def _len(value_coro, expected: int) -> bool:
    return len(await value_coro) == expected


def _counter(kit, name: str, topic: str, at_least: int) -> bool:
    metric = getattr(kit.metrics, name)
    return metric.labels(topic)._value.get() >= at_least


def _epoch():
    from datetime import UTC, datetime

    return datetime(2000, 1, 1, tzinfo=UTC)


async def _publish_raw(bootstrap: str, topic: str, event: AuditRecorded) -> None:
    """`event` straight onto a topic (on the broker's name), as another deployment's relay would put it."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, event.model_dump_json().encode(), key=event.key())
    finally:
        await producer.stop()
