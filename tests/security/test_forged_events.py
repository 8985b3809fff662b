"""Issue 28, item 1 (and item 5's forged events): every topic that changes access or money is authenticated.

For every topic and every event type that grants access, creates allocations or posts money
(gpuaas.contracts.emitters.ACCESS_OR_MONEY: app-runtime's `access_grant.requested` and `instance.created`,
metering's `usage.recorded`, allocations' `ssh_grant.created`, catalog's entitlements, identity's
memberships...), three forgeries are written straight to the real broker, as anyone with write access
could:

- unsigned: the right `source`, no signature;
- wrong key: the right `source`, signed with another service's (genuine) key;
- wrong source: a service's own valid signature on a type only another service may emit there.

Every service consuming the topic parks each of them in its dead letters with the reason, and none
changes anything: no inbox row (the handlers never ran), and the tables those events would write hold
the same rows as before. Real Postgres and a real broker (the session's `infra`); every consuming service
runs in-process with its own schema and consumer group. Per-service Kafka principals and ACLs (the
transport half) are test_kafka_acls.py's.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from sqlalchemy import func, select, table

from gpuaas.allocations.app import SPEC as ALLOCATIONS
from gpuaas.app_runtime.app import SPEC as APP_RUNTIME
from gpuaas.billing.app import SPEC as BILLING
from gpuaas.catalog.app import SPEC as CATALOG
from gpuaas.contracts import EVENT_TYPES, TOPICS, Event
from gpuaas.contracts.emitters import ACCESS_OR_MONEY, SERVICES, topic_emitters
from gpuaas.contracts.registry import IDENTITY
from gpuaas.contracts.testing import sample_event
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.tables import dead_letters, inbox
from gpuaas.kit.testing import event_signer_of, running, service_app, wait_for
from gpuaas.metering.app import SPEC as METERING

pytestmark = pytest.mark.integration

CONSUMING = (ALLOCATIONS, APP_RUNTIME, METERING, BILLING, CATALOG)

# What a forged event would have written, per service (kit tables every service has, then its own).
KIT_TABLES = ("inbox", "outbox", "iam_users", "iam_memberships", "iam_service_accounts", "iam_projects")
EFFECT_TABLES = {
    "allocations": ("allocations", "ssh_grants", "agent_tasks", "app_members", "catalog_runtimes"),
    "app_runtime": ("allocations", "entitlements", "instances", "members", "manifests"),
    "metering": ("meters", "usage_records", "app_usage_records", "instances", "members", "hosts"),
    "billing": ("charges", "usage_received", "ledger_entries", "spend"),
    "catalog": ("entitlements", "instance_digests"),
}

HOW = ("unsigned", "wrong_key", "wrong_source")
REASON = {"unsigned": "unsigned event", "wrong_key": "not a key of", "wrong_source": "may not emit"}


def forgeries(topic: str, event_type: str) -> dict[str, tuple[Event, bytes]]:
    """The three forgeries of one (topic, type), each a fresh event id, as bytes on the wire."""
    owner = sorted(topic_emitters(topic))[0]
    other = next(s for s in SERVICES if s not in topic_emitters(topic))
    cls = EVENT_TYPES[event_type]
    out: dict[str, tuple[Event, bytes]] = {}
    unsigned = sample_event(cls, source=owner)
    out["unsigned"] = (unsigned, unsigned.model_dump_json().encode())
    wrong_key = sample_event(cls, source=owner)
    out["wrong_key"] = (wrong_key, event_signer_of(other).sign_payload(wrong_key.model_dump_json().encode()))
    wrong_source = sample_event(cls, source=other)
    out["wrong_source"] = (wrong_source, event_signer_of(other).sign_payload(wrong_source.model_dump_json().encode()))
    return out


@pytest.fixture(scope="module")
async def consumers(infra: Any) -> AsyncIterator[dict[str, KitRuntime]]:
    async with AsyncExitStack() as stack:
        kits: dict[str, KitRuntime] = {}
        for spec in CONSUMING:
            app = await service_app(spec, infra.admin_url, infra.kafka_bootstrap)
            _, kit = await stack.enter_async_context(running(app))
            kits[spec.name] = kit
        yield kits


async def row_counts(kit: KitRuntime) -> dict[str, int]:
    counts: dict[str, int] = {}
    async with kit.sessions() as session:
        for name in (*KIT_TABLES, *EFFECT_TABLES[kit.spec.name]):
            counts[name] = (await session.execute(select(func.count()).select_from(table(name)))).scalar_one()
    return counts


async def test_forged_access_and_money_events_are_parked_and_change_nothing(
    infra: Any, consumers: dict[str, KitRuntime]
) -> None:
    before = {name: await row_counts(kit) for name, kit in consumers.items()}
    sent: dict[str, dict[uuid.UUID, tuple[str, str]]] = {}  # topic -> event id -> (type, how)
    producer = AIOKafkaProducer(bootstrap_servers=infra.kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for topic, types in sorted(ACCESS_OR_MONEY.items()):
            for event_type in sorted(types):
                for how, (event, value) in forgeries(topic, event_type).items():
                    await (await producer.send(topic, value, key=event.key()))
                    sent.setdefault(topic, {})[event.id] = (event_type, how)
    finally:
        await producer.stop()
    assert {t for t in sent} == set(ACCESS_OR_MONEY)

    checked: set[tuple[str, str]] = set()
    for name, kit in consumers.items():
        for topic in sorted(kit.subscriptions.topics & set(sent)):
            ids = sent[topic]

            async def all_parked(k: KitRuntime = kit, wanted: frozenset[uuid.UUID] = frozenset(ids)) -> Any:
                async with k.sessions() as session:
                    rows = await session.execute(
                        select(dead_letters.c.event_id, dead_letters.c.error, dead_letters.c.topic).where(
                            dead_letters.c.event_id.in_(wanted)
                        )
                    )
                parked = list(rows.all())
                return parked if len(parked) == len(wanted) else None

            rows = await wait_for(all_parked, 90, f"{name} parking every forgery on {topic}")
            for row in rows:
                event_type, how = ids[row.event_id]
                assert row.error.startswith("rejected:"), (name, event_type, how, row.error)
                assert REASON[how] in row.error, (name, event_type, how, row.error)
                checked.add((event_type, how))
            async with kit.sessions() as session:
                applied = await session.execute(select(inbox.c.event_id).where(inbox.c.event_id.in_(set(ids))))
                assert applied.first() is None, f"{name} applied a forgery on {topic}"
    # Every type and every kind of forgery reached at least one consumer that refused it.
    wanted = {(t, h) for types in ACCESS_OR_MONEY.values() for t in types for h in HOW}
    assert checked == wanted, sorted(wanted - checked)
    for name, kit in consumers.items():
        assert await row_counts(kit) == before[name], f"a forged event changed {name}'s state"


def test_every_access_or_money_topic_has_a_consumer_here() -> None:
    """The suite covers every authenticated topic some service consumes (billing's has no consumer yet)."""
    consumed = {t for spec in CONSUMING for t in (spec.subscriptions.topics if spec.subscriptions else ())}
    consumed |= {IDENTITY} if all(spec.with_iam for spec in CONSUMING) else set()
    for topic in ACCESS_OR_MONEY:
        assert topic in TOPICS
        assert topic in consumed or not TOPICS[topic].consumers, topic
