"""Kafka connection security through the kit, against a real Apache Kafka with a SASL_PLAINTEXT listener
(PLAIN, JAAS users) and the StandardAuthorizer with ACLs (gpuaas.devstack.kafka, jars from `make kafka-jars`).

A service whose settings carry SASL credentials publishes through its outbox relay and another consumes through
the kit's consumer, with ACLs limited to their topic prefix; a wrong password is refused; a principal without a
Write ACL cannot produce; the topics the kit creates carry the configured replication and `min.insync.replicas`.
Skipped only when Java or the broker's jars are unavailable (they are in CI: `make test-kafka`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    InvalidReplicationFactorError,
    KafkaConnectionError,
    TopicAuthorizationFailedError,
)
from pydantic import ValidationError

from gpuaas.contracts.registry import AUDIT, TOPICS
from gpuaas.devstack.infra import free_port
from gpuaas.devstack.kafka import ApacheKafka, KafkaError, create_acls, ensure_jars, java_binary
from gpuaas.kit.kafka import client_security, ensure_topics, make_producer
from gpuaas.kit.outbox import add_events
from gpuaas.kit.settings import ServiceSettings
from gpuaas.kit.testing import build, new_service_db, running, wait_for

from .test_outbox_inbox import audit_event, counting_handlers, fetch, make_applied_table

USERS = {"admin": "admin-secret", "svc": "svc-secret", "reader": "reader-secret"}


def require_apache_kafka() -> None:
    try:
        java_binary()
        ensure_jars()
    except KafkaError as exc:
        pytest.skip(f"Apache Kafka unavailable here (Java 17 and `make kafka-jars` needed): {exc}")


@pytest.fixture(scope="module")
def sasl_kafka() -> Iterator[ApacheKafka]:
    require_apache_kafka()
    root = Path(tempfile.mkdtemp(prefix="gpuaas-kafka-sasl-"))
    broker = ApacheKafka(
        root, port=free_port(), log_path=root / "kafka.log", sasl_users=USERS, acls=True, super_users=("admin",)
    )
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tls_kafka() -> Iterator[ApacheKafka]:
    """A SASL_SSL listener (PLAIN over TLS) with a certificate from the broker's own CA; no ACLs."""
    require_apache_kafka()
    if not shutil.which("openssl"):
        pytest.skip("the TLS broker's certificates need the openssl command")
    root = Path(tempfile.mkdtemp(prefix="gpuaas-kafka-tls-"))
    broker = ApacheKafka(
        root, port=free_port(), log_path=root / "kafka.log", sasl_users={"svc": USERS["svc"]}, tls=True
    )
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
        shutil.rmtree(root, ignore_errors=True)


def sasl_settings(broker: ApacheKafka, user: str, password: str | None = None, **overrides: Any) -> dict[str, Any]:
    """The settings a service reads from GPUAAS_KAFKA_* for this broker's SASL listener."""
    return {
        "kafka_bootstrap": broker.sasl_bootstrap,
        "kafka_security_protocol": "SASL_PLAINTEXT",
        "kafka_sasl_mechanism": "PLAIN",
        "kafka_sasl_username": user,
        "kafka_sasl_password": USERS[user] if password is None else password,
        **overrides,
    }


def security_of(broker: ApacheKafka, user: str, password: str | None = None) -> dict[str, Any]:
    return client_security(ServiceSettings(**sasl_settings(broker, user, password)))


async def topic_configs(broker: ApacheKafka, topic: str) -> dict[str, tuple[str, int]]:
    """{config name: (value, config source)} of one topic (source 1: set on the topic, 5: broker default)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.sasl_bootstrap, **security_of(broker, "admin"))
    await admin.start()
    try:
        [response] = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
        [resource] = response.resources
        assert resource[0] == 0, resource
        return {entry[0]: (entry[1], entry[3]) for entry in resource[4]}
    finally:
        await admin.close()


async def replication_of(broker: ApacheKafka, topic: str) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.sasl_bootstrap, **security_of(broker, "admin"))
    await admin.start()
    try:
        [described] = await admin.describe_topics([topic])
        return len(described["partitions"][0]["replicas"])
    finally:
        await admin.close()


def test_settings_read_the_chart_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The names deploy/helm/gpuaas sets are the ones the settings read; the password stays a secret."""
    env = {
        "GPUAAS_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "GPUAAS_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "GPUAAS_KAFKA_SASL_USERNAME": "billing",
        "GPUAAS_KAFKA_SASL_PASSWORD": "s3cret",
        "GPUAAS_KAFKA_TOPIC_REPLICATION_FACTOR": "3",
        "GPUAAS_KAFKA_TOPIC_MIN_INSYNC_REPLICAS": "2",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    s = ServiceSettings()
    assert (s.kafka_security_protocol, s.kafka_sasl_mechanism, s.kafka_sasl_username) == (
        "SASL_SSL",
        "SCRAM-SHA-512",
        "billing",
    )
    assert "s3cret" not in repr(s)
    assert (s.kafka_topic_replication_factor, s.kafka_topic_min_insync_replicas) == (3, 2)
    options = client_security(s)
    assert options["security_protocol"] == "SASL_SSL"
    assert options["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (options["sasl_plain_username"], options["sasl_plain_password"]) == ("billing", "s3cret")
    assert options["ssl_context"].check_hostname  # TLS verifies the broker (system CAs: no CA file given)
    for name in env:
        monkeypatch.delenv(name)
    assert client_security(ServiceSettings()) == {}  # the default: plaintext, clients unchanged


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kafka_security_protocol": "SASL_SSL"}, "needs a SASL username and password"),
        ({"kafka_security_protocol": "TLS"}, "kafka_security_protocol"),
        ({"kafka_sasl_mechanism": "GSSAPI"}, "kafka_sasl_mechanism"),
        ({"kafka_ssl_certfile": "/etc/tls.crt"}, "go together"),
        ({"kafka_topic_min_insync_replicas": 2}, "cannot exceed"),
    ],
)
def test_incomplete_or_unknown_security_settings_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ServiceSettings(**overrides)


@pytest.mark.integration
async def test_services_publish_and_consume_over_sasl_with_prefix_acls(infra, sasl_kafka: ApacheKafka) -> None:
    """Outbox → relay → SASL listener → consumer → handler, both services authenticated as `svc`, whose ACLs
    cover only its deployment's topic and group prefix; the topics are created with the configured settings."""
    run = uuid.uuid4().hex
    prefix = f"sec{run[:8]}."
    await create_acls(
        sasl_kafka.bootstrap,
        "User:svc",
        [("topic", prefix, "all"), ("group", prefix, "all")],
    )
    overrides = sasl_settings(
        sasl_kafka,
        "svc",
        kafka_topic_prefix=prefix,
        kafka_topic_replication_factor=1,
        kafka_topic_min_insync_replicas=1,
    )
    del overrides["kafka_bootstrap"]  # build() takes it as an argument
    prod_name, prod_url = await new_service_db(infra.admin_url, "sprod")
    cons_name, cons_url = await new_service_db(infra.admin_url, "scons")
    await make_applied_table(cons_url, cons_name)
    producer = build(prod_name, prod_url, sasl_kafka.sasl_bootstrap, with_iam=False, settings=overrides)
    consumer = build(
        cons_name,
        cons_url,
        sasl_kafka.sasl_bootstrap,
        with_iam=False,
        subscriptions=counting_handlers(run),
        settings={**overrides, "consumer_group": cons_name},
    )
    async with running(producer) as (_, pkit), running(consumer):
        assert pkit.settings.kafka_security_protocol == "SASL_PLAINTEXT"
        async with pkit.sessions() as s, s.begin():
            await add_events(s, [audit_event(run, f"agg-{i}", i) for i in range(20)])

        async def applied() -> int:
            return (await fetch(cons_url, cons_name, "SELECT count(*) FROM applied"))[0][0]

        async def all_applied() -> bool:
            return await applied() == 20

        await wait_for(all_applied, 60, "events applied over SASL")

    configs = await topic_configs(sasl_kafka, prefix + AUDIT)
    assert configs["min.insync.replicas"] == ("1", 1)  # set on the topic by the kit, not the broker default
    compacted = next(t.name for t in TOPICS.values() if t.compacted)
    assert (await topic_configs(sasl_kafka, prefix + compacted))["cleanup.policy"][0] == "compact,delete"
    assert await replication_of(sasl_kafka, prefix + AUDIT) == 1


@pytest.mark.integration
async def test_wrong_password_is_refused(sasl_kafka: ApacheKafka, caplog: pytest.LogCaptureFixture) -> None:
    wrong = security_of(sasl_kafka, "svc", "not-the-password")
    producer = make_producer(sasl_kafka.sasl_bootstrap, 1_000_000, wrong)
    with caplog.at_level(logging.ERROR, logger="aiokafka"), pytest.raises(KafkaConnectionError):
        try:
            await asyncio.wait_for(producer.start(), 30)
        finally:
            await producer.stop()
    assert "Authentication failed" in caplog.text  # refused by SASL, not an unreachable broker
    with pytest.raises(KafkaConnectionError):
        await ensure_topics(sasl_kafka.sasl_bootstrap, [AUDIT], prefix="wrongpw.", security=wrong, timeout_s=20)
    # The same client with the right password gets in (the refusal above is the password's).
    producer = make_producer(sasl_kafka.sasl_bootstrap, 1_000_000, security_of(sasl_kafka, "svc"))
    await asyncio.wait_for(producer.start(), 30)
    await producer.stop()


@pytest.mark.integration
async def test_principal_without_write_acl_cannot_produce(sasl_kafka: ApacheKafka) -> None:
    """`reader` may read the topics (and use its group) but not write them: the broker refuses its producer,
    while `admin` (a super user) writes and `reader` reads what was written."""
    topic_prefix = f"ro{uuid.uuid4().hex[:8]}."
    await ensure_topics(
        sasl_kafka.sasl_bootstrap, [AUDIT], prefix=topic_prefix, security=security_of(sasl_kafka, "admin")
    )
    await create_acls(
        sasl_kafka.bootstrap,
        "User:reader",
        [("topic", topic_prefix, "read"), ("topic", topic_prefix, "describe"), ("group", topic_prefix, "read")],
    )
    topic = topic_prefix + AUDIT

    reader = make_producer(sasl_kafka.sasl_bootstrap, 1_000_000, security_of(sasl_kafka, "reader"))
    await reader.start()
    try:
        with pytest.raises(TopicAuthorizationFailedError):
            await asyncio.wait_for(reader.send_and_wait(topic, b"forbidden"), 30)
    finally:
        await reader.stop()

    admin = make_producer(sasl_kafka.sasl_bootstrap, 1_000_000, security_of(sasl_kafka, "admin"))
    await admin.start()
    try:
        await asyncio.wait_for(admin.send_and_wait(topic, b"allowed", key=b"k"), 30)
    finally:
        await admin.stop()
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=sasl_kafka.sasl_bootstrap,
        group_id=topic_prefix + "readers",
        auto_offset_reset="earliest",
        **security_of(sasl_kafka, "reader"),
    )
    await consumer.start()
    try:
        batches = await asyncio.wait_for(consumer.getmany(timeout_ms=10_000), 30)
        values = [m.value for records in batches.values() for m in records]
        assert values == [b"allowed"]
    finally:
        await consumer.stop()


@pytest.mark.integration
async def test_topics_get_the_configured_min_insync_replicas_and_replication(sasl_kafka: ApacheKafka) -> None:
    admin = security_of(sasl_kafka, "admin")
    strict = f"isr{uuid.uuid4().hex[:8]}."
    await ensure_topics(sasl_kafka.sasl_bootstrap, [AUDIT], prefix=strict, security=admin, min_insync_replicas=2)
    assert (await topic_configs(sasl_kafka, strict + AUDIT))["min.insync.replicas"] == ("2", 1)
    # (Not checked by producing: Kafka 4 caps the effective min.insync.replicas at the replication factor.)

    default = f"dflt{uuid.uuid4().hex[:8]}."
    await ensure_topics(sasl_kafka.sasl_bootstrap, [AUDIT], prefix=default, security=admin)
    _value, source = (await topic_configs(sasl_kafka, default + AUDIT))["min.insync.replicas"]
    assert source != 1, "min.insync.replicas set on the topic although no value was configured"

    # More replicas than brokers: the broker's refusal is raised, not swallowed (the topic would be missing).
    with pytest.raises(InvalidReplicationFactorError):
        await ensure_topics(
            sasl_kafka.sasl_bootstrap,
            [AUDIT],
            prefix=f"rf{uuid.uuid4().hex[:8]}.",
            security=admin,
            replication_factor=3,
        )


@pytest.mark.integration
async def test_sasl_ssl_verifies_the_broker_against_the_configured_ca(tls_kafka: ApacheKafka) -> None:
    """SASL over TLS as the chart configures it (GPUAAS_KAFKA_SSL_CAFILE): the kit's admin, producer and a consumer
    with the same options work; without the CA (the system CAs) the broker's certificate is refused."""
    settings = ServiceSettings(
        **sasl_settings(tls_kafka, "svc", kafka_security_protocol="SASL_SSL", kafka_ssl_cafile=str(tls_kafka.ca_file))
    )
    security = client_security(settings)
    assert security["ssl_context"].check_hostname
    prefix = f"tls{uuid.uuid4().hex[:8]}."
    await ensure_topics(tls_kafka.sasl_bootstrap, [AUDIT], prefix=prefix, security=security)
    producer = make_producer(tls_kafka.sasl_bootstrap, 1_000_000, security)
    await producer.start()
    try:
        await asyncio.wait_for(producer.send_and_wait(prefix + AUDIT, b"over-tls", key=b"k"), 30)
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        prefix + AUDIT,
        bootstrap_servers=tls_kafka.sasl_bootstrap,
        group_id=prefix + "tls",
        auto_offset_reset="earliest",
        **security,
    )
    await consumer.start()
    try:
        batches = await asyncio.wait_for(consumer.getmany(timeout_ms=10_000), 30)
        assert [m.value for records in batches.values() for m in records] == [b"over-tls"]
    finally:
        await consumer.stop()

    untrusted = client_security(
        ServiceSettings(**sasl_settings(tls_kafka, "svc", kafka_security_protocol="SASL_SSL"))
    )  # no CA file: the system CAs, which never signed this broker's certificate
    with pytest.raises(KafkaConnectionError):
        await ensure_topics(tls_kafka.sasl_bootstrap, [AUDIT], prefix=prefix, security=untrusted, timeout_s=15)
