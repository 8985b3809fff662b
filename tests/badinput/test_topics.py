"""Malformed events on every topic: each consumer parks them in its dead letters (or ignores an unknown
event type, by contract), keeps running, and applies the valid event that follows them on the same
partition exactly once."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from aiokafka import AIOKafkaProducer

from gpuaas.contracts import TOPICS, Actor
from gpuaas.contracts.events.audit import AuditRecord, AuditRecorded
from gpuaas.contracts.registry import AUDIT
from gpuaas.devstack.stack import SERVICES, Stack
from gpuaas.devstack.waiting import eventually

pytestmark = pytest.mark.e2e


def malformed(topic: str, run: str) -> list[tuple[str, bytes | None]]:
    """(label, value) pairs that must each be dead-lettered by every consumer of `topic`."""
    known = next(iter(TOPICS[topic].by_type))
    envelope = {"id": str(uuid.uuid4()), "type": known, "source": "badinput", "subject": run}
    return [
        ("not-json", b"{this is not json"),
        ("not-utf8", b"\xff\xfe\xfa garbage"),
        ("json-array", b"[1, 2, 3]"),
        ("json-scalar", b'"just a string"'),
        ("known-type-missing-fields", json.dumps(envelope).encode()),
        ("known-type-wrong-types", json.dumps({**envelope, "time": 12, "data": "nope", "actor": []}).encode()),
        ("tombstone", None),
        ("large-junk", json.dumps({"type": known, "pad": "x" * 700_000}).encode()),
        ("deep-nesting", b'{"type": "' + known.encode() + b'", "data": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ]


def consumers_of(topic: str) -> list[str]:
    return [s for s in TOPICS[topic].consumers if s in SERVICES]


async def parked(stack: Stack, service: str, topic: str, since_offset: int, key: bytes) -> int:
    return await stack.fetchval(
        service,
        'SELECT count(*) FROM dead_letters WHERE topic = $1 AND key = $2 AND "offset" >= $3',
        topic,
        key,
        since_offset,
    )


async def test_malformed_events_are_dead_lettered_and_never_stop_a_consumer(stack: Stack) -> None:
    run = uuid.uuid4().hex[:8]
    key = f"badinput-{run}".encode()
    pids = {s: stack.pid(s) for s in SERVICES}
    producer = AIOKafkaProducer(
        bootstrap_servers=stack.kafka_bootstrap, acks="all", max_request_size=2_000_000, linger_ms=5
    )
    await producer.start()
    expected: dict[tuple[str, str], int] = {}
    first_offset: dict[str, int] = {}
    try:
        for topic in TOPICS:
            cases = malformed(topic, run)
            # An event type nobody knows yet: ignored by contract, never parked.
            unknown = {"id": str(uuid.uuid4()), "type": "badinput.future_type", "source": "badinput", "data": {}}
            offsets = []
            for _, value in cases:
                offsets.append((await producer.send_and_wait(topic, value, key=key)).offset)
            await producer.send_and_wait(topic, json.dumps(unknown).encode(), key=key)
            first_offset[topic] = min(offsets)
            for svc in consumers_of(topic):
                expected[(svc, topic)] = len(cases)
        # A valid event behind the junk on the audit topic's same partition: identity applies it.
        valid = AuditRecorded.build(
            subject=run,
            source="allocations",
            actor=Actor.system("badinput"),
            data=AuditRecord(service=run, action="badinput.after", resource_type="probe", resource_id=run),
        )
        await producer.send_and_wait(AUDIT, valid.model_dump_json().encode(), key=key)
    finally:
        await producer.stop()
    assert expected, "no topic has a consumer among the services"

    async def all_parked() -> bool:
        for (svc, topic), n in expected.items():
            if await parked(stack, svc, topic, first_offset[topic], key) != n:
                return False
        return True

    async def state() -> dict:
        return {
            f"{svc}:{topic}": await parked(stack, svc, topic, first_offset[topic], key) for (svc, topic) in expected
        }

    try:
        await eventually(all_parked, 90, "every malformed event parked by every consumer")
    except AssertionError as exc:
        want = next(iter(expected.values()))
        raise AssertionError(f"{exc}; parked now (want {want} each): {await state()}") from None

    async def applied() -> bool:
        n = await stack.fetchval("identity", "SELECT count(*) FROM audit_records WHERE service = $1", run)
        return n == 1

    await eventually(applied, 60, "the valid event after the junk applied")
    # A probe behind everything on the same partition: once identity has stored it, whatever the junk and the
    # valid event could still cause (a second application, another parked copy) would show.
    probe = AuditRecorded.build(
        subject=run,
        source="allocations",
        actor=Actor.system("badinput"),
        data=AuditRecord(service=f"{run}-probe", action="badinput.probe", resource_type="probe", resource_id=run),
    )
    producer = AIOKafkaProducer(bootstrap_servers=stack.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(AUDIT, probe.model_dump_json().encode(), key=key)
    finally:
        await producer.stop()

    async def probed() -> bool:
        n = await stack.fetchval("identity", "SELECT count(*) FROM audit_records WHERE service = $1", f"{run}-probe")
        return n == 1

    await eventually(probed, 60, "the probe behind the valid event applied")
    assert await stack.fetchval("identity", "SELECT count(*) FROM audit_records WHERE service = $1", run) == 1
    assert await all_parked(), f"parked now: {await state()}"
    # Every consumer is the same process, still assigned, still ready.
    assert {s: stack.pid(s) for s in SERVICES} == pids
    async with httpx.AsyncClient(timeout=10) as c:
        for svc in SERVICES:
            r = await c.get(f"{stack.service_url(svc)}/readyz")
            assert r.status_code == 200, (svc, r.text)
    # The unknown type was ignored, not parked.
    for svc in SERVICES:
        assert (
            await stack.fetchval(
                svc, "SELECT count(*) FROM dead_letters WHERE key = $1 AND payload LIKE $2", key, b"%future_type%"
            )
            == 0
        )
