"""Test support for event-driven services: build the events a service consumes, then either apply them
in-process through the service's own handlers (fast, deterministic: the test knows when they are in) or
put them on the real broker (to prove the consumer path itself).

    async with running(app, jwks=signer.jwks) as (client, kit):
        await apply_events(kit, *identity_world(...), tenant_created(t, "t1"))
        await publish(infra.kafka_bootstrap, [usage_event])   # through the consumer

`apply_events` runs the handlers the way the consumer does, in one transaction: every event's handlers in
order, and consecutive events taken by one batch handler (`Subscriptions.on_batch`) in one call, with the
event's correlation bound. It writes no inbox row: an event applied here and also published is applied
again by the consumer, which every handler tolerates (state events are versioned, records keyed).
"""

# aiokafka and asyncpg ship no type information, so what this module gets back from them is unknown to the
# checker: it does not report those unknowns here (what the module itself exports is annotated).
# pyright: reportMissingTypeStubs=false, reportUnknownMemberType=false
# pyright: reportUnknownVariableType=false, reportUnknownArgumentType=false
from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaProducer

from gpuaas.contracts import Event, topic_of
from gpuaas.contracts.enums import MembershipScope, Role
from gpuaas.contracts.events import identity as identity_events
from gpuaas.kit.app import KitRuntime
from gpuaas.kit.consumer import run_handlers
from gpuaas.kit.testing import event_signer_of

IDENTITY = "identity"


async def apply_events(kit: KitRuntime, *events: Event) -> None:
    """Apply `events` through the service's subscriptions (its handlers and the IAM projection's), in
    order, in one transaction, as one consumed batch would be."""
    subs = kit.subscriptions
    async with kit.sessions() as session, session.begin():
        i = 0
        while i < len(events):
            batch_handler = subs.batch.get(events[i].type)
            if batch_handler is None:
                await run_handlers(session, events[i], subs.handlers.get(events[i].type, []))
                i += 1
                continue
            j = i + 1
            while j < len(events) and subs.batch.get(events[j].type) is batch_handler:
                j += 1
            await batch_handler(session, list(events[i:j]))
            i = j


async def publish(bootstrap: str, events: Sequence[Event], security: Mapping[str, Any] | None = None) -> None:
    """Put events on their topics on the real broker, keyed as their producers key them, and wait for
    every acknowledgement (in order per key: one partition each). `security`: `kit.kafka.client_security`."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, **(security or {}))
    await producer.start()
    try:
        sent = [await producer.send(topic_of(e).name, signed_payload(e), key=e.key()) for e in events]
        for ack in sent:
            await ack
    finally:
        await producer.stop()


def signed_payload(event: Event) -> bytes:
    """The bytes the event's producer would publish: signed with the test key of its source (as that service's
    relay signs), so that test apps, which trust the test keys, accept it."""
    return event_signer_of(event.source).sign_payload(event.model_dump_json().encode())


# ---------------------------------------------------------------------------- identity, as services see it


def tenant_created(tenant_id: uuid.UUID, slug: str, name: str | None = None) -> Event:
    data = identity_events.TenantState(tenant_id=tenant_id, slug=slug, name=name or slug.upper())
    return identity_events.TenantCreated.build(subject=tenant_id, source=IDENTITY, data=data)


def project_created(project_id: uuid.UUID, tenant_id: uuid.UUID, name: str) -> Event:
    data = identity_events.ProjectState(project_id=project_id, tenant_id=tenant_id, name=name)
    return identity_events.ProjectCreated.build(subject=project_id, source=IDENTITY, data=data)


def membership_granted(
    user_id: uuid.UUID,
    role: Role,
    tenant_id: uuid.UUID | None = None,
    project_id: uuid.UUID | None = None,
    scope: MembershipScope | None = None,
) -> Event:
    """A role for a user: at project scope when a project is given, else tenant scope (or `scope`)."""
    scope = scope or (MembershipScope.project if project_id else MembershipScope.tenant)
    data = identity_events.MembershipState(
        membership_id=uuid.uuid4(), user_id=user_id, scope=scope, role=role, tenant_id=tenant_id, project_id=project_id
    )
    return identity_events.MembershipGranted.build(subject=data.membership_id, source=IDENTITY, data=data)


def platform_admin(user_id: uuid.UUID) -> Event:
    return membership_granted(user_id, Role.platform_admin, scope=MembershipScope.platform)


def service_account_created(
    service_account_id: uuid.UUID,
    tenant_id: uuid.UUID,
    project_id: uuid.UUID,
    name: str,
    scopes: Sequence[str] = ("app-controller",),
) -> Event:
    data = identity_events.ServiceAccountState(
        service_account_id=service_account_id,
        tenant_id=tenant_id,
        project_id=project_id,
        name=name,
        scopes=list(scopes),
    )
    return identity_events.ServiceAccountCreated.build(subject=service_account_id, source=IDENTITY, data=data)


__all__ = [
    "apply_events",
    "membership_granted",
    "platform_admin",
    "project_created",
    "publish",
    "service_account_created",
    "signed_payload",
    "tenant_created",
]
