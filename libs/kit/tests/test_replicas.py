"""Two replicas of a service on one Postgres and one broker. Relays (a leader deposed mid-batch, two publishing at
once): every outbox row reaches the broker once, the events of one aggregate in `seq` order. Consumers (one
group): partitions are split, taken over when a replica stops, and every event is applied once, in order."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import defaultdict
from contextlib import AsyncExitStack

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from sqlalchemy import text

from gpuaas.contracts.registry import AUDIT
from gpuaas.kit.db import create_engine, session_factory, to_plain_url
from gpuaas.kit.kafka import ensure_topics, make_producer
from gpuaas.kit.metrics import ServiceMetrics
from gpuaas.kit.outbox import add_events
from gpuaas.kit.relay import OutboxRelay, advisory_key
from gpuaas.kit.testing import build, new_service_db, running, wait_for

from .test_outbox_inbox import audit_event, counting_handlers, fetch, make_applied_table

pytestmark = pytest.mark.integration

SUBJECTS = [f"agg-{i}" for i in range(6)]
PROBE = b"probe"  # not an event: marks the end of a partition for _read_all


async def _relays(infra, prefix: str, n: int, batch_size: int):
    """A schema with its outbox, and `n` relays on it, each with its own engine and producer (replicas)."""
    name, url = await new_service_db(infra.admin_url, "relayrep")
    await ensure_topics(infra.kafka_bootstrap, [AUDIT], prefix=prefix)
    relays, closers = [], []
    for i in range(n):
        engine = create_engine(url, name)
        producer: AIOKafkaProducer = make_producer(infra.kafka_bootstrap, 1_000_000)
        await producer.start()
        relays.append(
            OutboxRelay(
                schema=name,
                engine=engine,
                sessions=session_factory(engine),
                producer=producer,
                dsn=to_plain_url(url),
                metrics=ServiceMetrics(f"relayrep{i}"),
                batch_size=batch_size,
                topic_prefix=prefix,
            )
        )
        closers += [producer.stop, engine.dispose]
    return name, url, relays, closers


async def _stage(relay: OutboxRelay, run: str, rounds: int) -> int:
    """`rounds` transactions, each with one event per subject (seq = round): the per-subject order to keep."""
    for seq in range(rounds):
        async with relay.sessions() as s, s.begin():
            await add_events(s, [audit_event(run, subj, seq) for subj in SUBJECTS])
    return rounds * len(SUBJECTS)


async def _read_all(bootstrap: str, topic: str, timeout_s: float = 60) -> list[tuple[str, int, str]]:
    """(subject, seq, event id) of every record on the topic, in each partition's order, once the relays have
    stopped publishing: a probe is put at the end of each partition and everything before the probes is read,
    so a record published twice would be there too."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        partitions = sorted(await producer.partitions_for(topic))
        await asyncio.gather(*[await producer.send(topic, PROBE, partition=p) for p in partitions])
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"relayrep-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    per_partition: dict[int, list[tuple[str, int, str]]] = defaultdict(list)
    probed: set[int] = set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        while probed != set(partitions):
            assert loop.time() < deadline, f"timed out reading to the probes (seen on partitions {sorted(probed)})"
            batch = await consumer.getmany(timeout_ms=500)
            for tp, msgs in batch.items():
                for m in msgs:
                    if m.value == PROBE:
                        probed.add(tp.partition)
                    elif tp.partition not in probed:
                        env = json.loads(m.value)
                        per_partition[tp.partition].append((env["subject"], env["data"]["after"]["seq"], env["id"]))
    finally:
        await consumer.stop()
    return [r for part in sorted(per_partition) for r in per_partition[part]]


def _assert_once_in_order(records: list[tuple[str, int, str]], expected: int) -> None:
    ids = [eid for _, _, eid in records]
    assert len(ids) == expected, f"{len(ids)} records on the broker for {expected} outbox rows"
    assert len(set(ids)) == expected, "a row was published twice"
    for subj in SUBJECTS:
        seqs = [q for s, q, _ in records if s == subj]
        assert seqs == sorted(seqs), f"{subj}'s events reached the broker out of order: {seqs}"


async def test_a_new_leader_waits_for_the_batch_a_deposed_leader_still_publishes(infra) -> None:
    """The deposed leader's batch (rows it holds, not yet marked) must not be overtaken: SKIP LOCKED would
    publish the later rows first, out of order for the same aggregates."""
    run = uuid.uuid4().hex
    prefix = f"rr{run[:8]}."
    name, url, (relay,), closers = await _relays(infra, prefix, 1, batch_size=10)
    try:
        total = await _stage(relay, run, 4)  # 24 rows
        deposed = create_engine(url, name)
        admin = await asyncpg.connect(to_plain_url(infra.admin_url))
        async with deposed.connect() as held:
            tx = await held.begin()
            # What a leader mid-batch holds: the oldest 10 unsent rows, locked, not yet marked.
            await held.execute(text("SELECT seq FROM outbox WHERE sent_at IS NULL ORDER BY seq LIMIT 10 FOR UPDATE"))
            held_pid = (await held.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            new_leader = asyncio.create_task(relay.publish_batch())

            async def blocked() -> bool:  # the new leader's claim waits on the deposed leader's row locks
                waiting = "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))"
                return bool(await admin.fetchval(waiting, held_pid)) or new_leader.done()

            try:
                await wait_for(blocked, 30, "the new leader to reach the held rows")
            finally:
                await admin.close()
            assert not new_leader.done(), "the new leader published past rows another relay was still publishing"
            sent = (await held.execute(text("SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL"))).scalar_one()
            assert sent == 0
            await tx.rollback()  # the deposed leader dies: its batch was never marked
        await deposed.dispose()
        published = await asyncio.wait_for(new_leader, 30)
        assert published == 10, "the new leader takes over from the oldest unsent row"
        while await relay.publish_batch():
            pass
        _assert_once_in_order(await _read_all(infra.kafka_bootstrap, prefix + AUDIT), total)
    finally:
        for close in closers:
            await close()


async def test_two_relays_publishing_at_once_publish_each_row_once_in_order(infra) -> None:
    """Both replicas' publish loops run side by side (no leader lock: the worst case of a lost lock): each row
    is published once and every aggregate's events stay in order."""
    run = uuid.uuid4().hex
    prefix = f"rr{run[:8]}."
    _name, _url, relays, closers = await _relays(infra, prefix, 2, batch_size=7)
    try:
        total = await _stage(relays[0], run, 40)  # 240 rows, 35 batches

        async def drain(relay: OutboxRelay) -> int:
            n = 0
            while published := await relay.publish_batch():
                n += published
                await asyncio.sleep(0)
            return n

        counts = await asyncio.gather(*(drain(r) for r in relays))
        assert sum(counts) == total, f"rows published per relay: {counts}"
        _assert_once_in_order(await _read_all(infra.kafka_bootstrap, prefix + AUDIT), total)
    finally:
        for close in closers:
            await close()


async def test_two_consumers_of_one_service_share_partitions_and_apply_each_event_once(infra) -> None:
    """Two replicas of a consuming service (one group, one schema): they split the topic's partitions; one
    stops mid-flow and the other takes its partitions over; every event is applied once, in order."""
    run = uuid.uuid4().hex
    prod_name, prod_url = await new_service_db(infra.admin_url, "prod")
    cons_name, cons_url = await new_service_db(infra.admin_url, "cons")
    await make_applied_table(cons_url, cons_name)
    producer = build(prod_name, prod_url, infra.kafka_bootstrap, with_iam=False)
    replicas = [
        build(cons_name, cons_url, infra.kafka_bootstrap, with_iam=False, subscriptions=counting_handlers(run))
        for _ in range(2)
    ]

    async def applied() -> int:
        return (await fetch(cons_url, cons_name, "SELECT count(*) FROM applied"))[0][0]

    async with AsyncExitStack() as stack:
        _, pkit = await stack.enter_async_context(running(producer))
        first = AsyncExitStack()
        _, kit_a = await first.enter_async_context(running(replicas[0]))
        _, kit_b = await stack.enter_async_context(running(replicas[1]))

        def split() -> bool:
            a, b = kit_a.consumer.consumer.assignment(), kit_b.consumer.consumer.assignment()
            return bool(a) and bool(b) and not (a & b)

        await wait_for(split, 60, "the two replicas split the partitions")
        total = 0
        for seq in range(30):
            async with pkit.sessions() as s, s.begin():
                await add_events(s, [audit_event(run, subj, seq) for subj in SUBJECTS])
            total += len(SUBJECTS)
            if seq == 10:
                await first.aclose()  # replica A goes away mid-flow (its partitions move to B)
        await wait_for(lambda: _eq(applied(), total), 90, "every event applied by the surviving replica")
        # Probes: one more event per subject, each behind that subject's events in its partition. Once every
        # probe is applied, whatever was redelivered after the takeover has been consumed too.
        async with pkit.sessions() as s, s.begin():
            await add_events(s, [audit_event(run, subj, 30) for subj in SUBJECTS])
        total += len(SUBJECTS)
        await wait_for(lambda: _eq(applied(), total), 60, "the probes applied")
        assert await applied() == total
    rows = await fetch(cons_url, cons_name, "SELECT subject, seq FROM applied ORDER BY n")
    assert len({(s, q) for s, q in rows}) == total == len(rows), "an event was applied twice"
    for subj in SUBJECTS:
        seqs = [q for s, q in rows if s == subj]
        assert seqs == sorted(seqs), f"events of {subj} applied out of order"


async def _eq(value, expected: int) -> bool:
    return (await value) == expected


async def test_a_leader_is_back_when_the_server_drops_the_leaders_lock_session(infra) -> None:
    """What the relay's keepalive settings lead to when a leader's host vanishes: the server ends its lock session
    (here at once, by pg_terminate_backend); the lock is taken again from a new session (the standby's, or the old
    leader's if it is still alive to retry first), one leader at a time, and what is staged afterwards is published
    once, in order."""
    run = uuid.uuid4().hex
    prefix = f"rr{run[:8]}."
    name, _url, relays, closers = await _relays(infra, prefix, 2, batch_size=50)
    for r in relays:
        r.poll_interval_s = 0.2
    tasks = [asyncio.create_task(r.run()) for r in relays]
    admin = await asyncpg.connect(to_plain_url(infra.admin_url))

    async def holders() -> list[int]:
        rows = await admin.fetch(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = 0 "
            "AND objid = $1::bigint::oid",
            advisory_key(name),
        )
        return [r["pid"] for r in rows]

    try:
        await wait_for(lambda: sum(r.is_leader for r in relays) == 1, 15, "one leader")
        (dropped,) = await holders()
        await admin.execute("SELECT pg_terminate_backend($1)", dropped)

        async def new_holder() -> bool:
            return len(pids := await holders()) == 1 and pids[0] != dropped

        await wait_for(new_holder, 20, "the lock held again from a new session")
        await wait_for(lambda: sum(r.is_leader for r in relays) == 1, 15, "one leader again")
        total = await _stage(relays[0], run, 5)
        for _ in range(20):  # never two leaders while the other keeps trying
            assert sum(r.is_leader for r in relays) <= 1
            await asyncio.sleep(0.1)
        unsent = f"SELECT count(*) FROM {name}.outbox WHERE sent_at IS NULL"
        await wait_for(lambda: _eq(admin.fetchval(unsent), 0), 30, "every staged row sent")
        for r in relays:  # every publication is over before the topic is read
            r.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        _assert_once_in_order(await _read_all(infra.kafka_bootstrap, prefix + AUDIT), total)
    finally:
        await admin.close()
        for r in relays:
            r.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        for close in closers:
            await close()
