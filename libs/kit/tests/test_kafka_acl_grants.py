"""Kafka ACLs per service derived from the topic registry (gpuaas.kit.kafka_acls): each service writes only what
it owns, reads only what it consumes, and only identity may write the identity topic."""

from __future__ import annotations

from gpuaas.contracts import TOPICS
from gpuaas.kit.kafka_acls import SERVICES, commands, service_grants, writers


def granted(service: str, operation: str, prefix: str = "") -> set[str]:
    return {g.name for g in service_grants(service, prefix) if g.resource == "topic" and g.operation == operation}


def test_only_identity_may_write_the_identity_topic() -> None:
    assert writers("gpuaas.identity.v1") == ["identity"]
    for service in SERVICES:
        assert ("gpuaas.identity.v1" in granted(service, "write")) is (service == "identity")


def test_every_service_writes_the_audit_topic_and_its_own_topics_only() -> None:
    assert sorted(writers("gpuaas.audit.v1")) == sorted(SERVICES)
    for service in SERVICES:
        owned = {t.name for t in TOPICS.values() if t.owner == service}
        assert granted(service, "write") == owned | {"gpuaas.audit.v1"}


def test_a_service_reads_exactly_the_topics_it_consumes_and_describes_them_all() -> None:
    for service in SERVICES:
        assert granted(service, "read") == {t.name for t in TOPICS.values() if service in t.consumers}
        assert granted(service, "describe") == {t.name for t in TOPICS.values()}
    assert granted("billing", "read") == {"gpuaas.identity.v1", "gpuaas.usage.v1"}


def test_a_consumer_reads_its_own_group_named_as_the_kit_names_it() -> None:
    groups = {g.name for g in service_grants("app-runtime") if g.resource == "group"}
    assert groups == {"app_runtime"}
    assert {(g.name, g.operation) for g in service_grants("billing", "prod.") if g.resource == "group"} == {
        ("prod.billing", "read")
    }


def test_the_prefix_applies_to_every_topic_and_no_grant_is_repeated() -> None:
    grants = service_grants("allocations", "prod.")
    assert all(g.name.startswith("prod.") for g in grants)
    assert len(grants) == len(set(grants))


def test_the_commands_grant_literal_acls_to_each_service_user() -> None:
    lines = commands(prefix="p.", user_prefix="svc-")
    assert len(lines) == sum(len(service_grants(s, "p.")) for s in SERVICES)
    assert all("--resource-pattern-type literal" in line for line in lines)
    identity_writes = [line for line in lines if "--operation Write --topic p.gpuaas.identity.v1 " in line]
    assert len(identity_writes) == 1 and "User:svc-identity " in identity_writes[0]
