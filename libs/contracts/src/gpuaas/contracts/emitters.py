"""Which service may emit which event type on which topic: the check a consumer makes after the signature.

A valid signature says who sent an event; this table says whether that sender may say it. An
`access_grant.requested` signed by allocations' key is genuinely allocations', and still refused: only
app-runtime asks for access grants. Consumers (gpuaas.kit.event_signing) park an event whose `source`
is not listed here for its (topic, type), and verify its signature against that source's public key.

Every event type has exactly the emitters listed for its topic below; the audit topic is the one that
every service writes to (each signs with its own key). `ACCESS_OR_MONEY` names the types whose effects
grant access, create allocations or post money: the adversarial suite forges each of them.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuaas.contracts.registry import (
    ALLOCATIONS,
    APP_RUNTIME,
    AUDIT,
    BILLING,
    CATALOG,
    IDENTITY,
    TOPICS,
    USAGE,
)

# Every service that runs a relay (gpuaas.kit.relay) and so may publish.
SERVICES = ("identity", "allocations", "catalog", "app-runtime", "metering", "billing")

# topic -> the services that may emit its events. One owner per topic, except audit (every service).
_TOPIC_EMITTERS: Mapping[str, tuple[str, ...]] = {
    IDENTITY: ("identity",),
    ALLOCATIONS: ("allocations",),
    CATALOG: ("catalog",),
    APP_RUNTIME: ("app-runtime",),
    USAGE: ("metering",),
    BILLING: ("billing",),
    AUDIT: SERVICES,
}

EMITTERS: Mapping[tuple[str, str], frozenset[str]] = {
    (topic, event_type): frozenset(_TOPIC_EMITTERS[topic]) for topic in TOPICS for event_type in TOPICS[topic].by_type
}
"""(topic, event type) -> the services whose signed events of that type consumers accept."""

# Topics whose consumers accept only signed events from a listed emitter. Audit records change neither access
# nor money (identity only stores them), so its consumers take them unsigned; its producers still sign.
AUTHENTICATED_TOPICS = frozenset({IDENTITY, ALLOCATIONS, CATALOG, APP_RUNTIME, USAGE, BILLING})

ACCESS_OR_MONEY: Mapping[str, frozenset[str]] = {
    # memberships, users, service accounts: every service's IAM projection (who may do what)
    IDENTITY: frozenset(
        {
            "membership.granted",
            "membership.changed",
            "membership.revoked",
            "user.created",
            "user.updated",
            "service_account.created",
            "service_account.updated",
            "service_account.disabled",
            "session.revoked",
        }
    ),
    # SSH grants and allocation lifecycles: app-runtime's access and metering's meters (money)
    ALLOCATIONS: frozenset({"ssh_grant.created", "allocation.activated", "allocation.released"}),
    # entitlements: who may launch an app
    CATALOG: frozenset({"entitlement.granted", "entitlement.revoked"}),
    # allocations installs SSH keys from access grants and creates (billed) allocations from instances
    APP_RUNTIME: frozenset({"access_grant.requested", "access_grant.updated", "instance.created", "member.added"}),
    # billing posts charges from usage records
    USAGE: frozenset({"usage.recorded", "app_usage.recorded", "meter.opened", "meter.closed"}),
}
"""Per topic, the event types that grant access, create allocations or post money."""


def emitters_of(topic: str, event_type: str) -> frozenset[str]:
    """The services that may emit `event_type` on `topic` (empty: nobody; the event is refused)."""
    return EMITTERS.get((topic, event_type), frozenset())


def may_emit(source: str, topic: str, event_type: str) -> bool:
    return source in emitters_of(topic, event_type)


def topic_emitters(topic: str) -> frozenset[str]:
    """Every service that may emit some event on `topic` (a consumer of it needs all their public keys)."""
    return frozenset(_TOPIC_EMITTERS[topic])


def _check() -> None:
    if set(_TOPIC_EMITTERS) != set(TOPICS):
        raise ValueError("every topic needs its emitters listed in gpuaas.contracts.emitters")
    for topic, emitters in _TOPIC_EMITTERS.items():
        owner = TOPICS[topic].owner
        if owner != "*" and emitters != (owner,):
            raise ValueError(f"{topic}: its registered owner {owner!r} is its only emitter")
    for topic, types in ACCESS_OR_MONEY.items():
        unknown = types - set(TOPICS[topic].by_type)
        if unknown:
            raise ValueError(f"{topic}: {sorted(unknown)} are not event types of this topic")
        if topic not in AUTHENTICATED_TOPICS:
            raise ValueError(f"{topic} carries access or money: it must be authenticated")


_check()
