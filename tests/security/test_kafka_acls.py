"""Issue 17, defect 8 (transport): per-service SASL users and ACLs on Apache Kafka, from the registry
(gpuaas.kit.kafka_acls). Only identity may write the identity topic; a service runs with exactly its grants.

Needs Java 17+ and the Kafka jars (`make kafka-jars`); skipped otherwise, like libs/kit's SASL tests.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import GroupAuthorizationFailedError, TopicAuthorizationFailedError

from gpuaas.contracts.registry import AUDIT, BILLING, IDENTITY
from gpuaas.devstack.infra import free_port
from gpuaas.devstack.kafka import ApacheKafka, KafkaError, create_acls, ensure_jars, java_binary
from gpuaas.kit import iam
from gpuaas.kit.auth import Principal
from gpuaas.kit.kafka import client_security, ensure_topics, make_producer
from gpuaas.kit.kafka_acls import SERVICES, service_grants
from gpuaas.kit.settings import ServiceSettings
from gpuaas.kit.testing import build, new_service_db, running, wait_for
from gpuaas.kit.testing_events import platform_admin, signed_payload

PASSWORDS = {f"gpuaas-{s}": f"pw-{s}-{uuid.uuid4().hex[:6]}" for s in SERVICES} | {"admin": "admin-pw"}


@pytest.fixture(scope="module")
def kafka() -> Iterator[ApacheKafka]:
    try:
        java_binary()
        ensure_jars()
    except KafkaError as exc:
        pytest.skip(f"Apache Kafka unavailable here (Java 17 and `make kafka-jars` needed): {exc}")
    root = Path(tempfile.mkdtemp(prefix="gpuaas-kafka-acls-"))
    broker = ApacheKafka(
        root, port=free_port(), log_path=root / "kafka.log", sasl_users=PASSWORDS, acls=True, super_users=("admin",)
    )
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
        shutil.rmtree(root, ignore_errors=True)


def sasl(kafka: ApacheKafka, service: str) -> dict[str, Any]:
    user = f"gpuaas-{service}"
    return {
        "kafka_bootstrap": kafka.sasl_bootstrap,
        "kafka_security_protocol": "SASL_PLAINTEXT",
        "kafka_sasl_mechanism": "PLAIN",
        "kafka_sasl_username": user,
        "kafka_sasl_password": PASSWORDS[user],
    }


def security(kafka: ApacheKafka, service: str) -> dict[str, Any]:
    return client_security(ServiceSettings(**sasl(kafka, service)))


@pytest.fixture(scope="module")
async def acl_cluster(kafka: ApacheKafka) -> ApacheKafka:
    """Topics created by the admin beforehand (as docs/operations.md says), then each service's ACLs."""
    await ensure_topics(kafka.bootstrap)  # the PLAINTEXT listener's principal is a super user
    for service in SERVICES:
        grants = [g.as_tuple() for g in service_grants(service)]
        await create_acls(kafka.bootstrap, f"User:gpuaas-{service}", grants, pattern="literal")
    return kafka


async def produce(kafka: ApacheKafka, service: str, topic: str, value: bytes) -> None:
    producer = make_producer(kafka.sasl_bootstrap, 1_000_000, security(kafka, service))
    await producer.start()
    try:
        await asyncio.wait_for(producer.send_and_wait(topic, value, key=b"k"), 30)
    finally:
        await producer.stop()


@pytest.mark.integration
async def test_only_identity_may_write_the_identity_topic(acl_cluster: ApacheKafka) -> None:
    forged = platform_admin(uuid.uuid4()).model_dump_json().encode()
    for service in SERVICES:
        if service == "identity":
            continue
        with pytest.raises(TopicAuthorizationFailedError):
            await produce(acl_cluster, service, IDENTITY, forged)
        await produce(acl_cluster, service, AUDIT, b"{}")  # what each service may write, it writes
    await produce(acl_cluster, "identity", IDENTITY, signed_payload(platform_admin(uuid.uuid4())))
    with pytest.raises(TopicAuthorizationFailedError):  # nor may identity write another owner's topic
        await produce(acl_cluster, "identity", BILLING, b"{}")


@pytest.mark.integration
async def test_a_service_runs_with_exactly_its_grants(infra: Any, acl_cluster: ApacheKafka) -> None:
    """A kit service authenticated as gpuaas-allocations starts (topics checked, group joined), applies a
    genuine identity event identity published, and cannot join another service's consumer group."""
    schema, url = await new_service_db(infra.admin_url, "acl_alloc", None)
    settings = {k: v for k, v in sasl(acl_cluster, "allocations").items() if k != "kafka_bootstrap"}
    app = build("allocations", url, acl_cluster.sasl_bootstrap, settings={"db_schema": schema, **settings})
    grant = platform_admin(uuid.uuid4())
    async with running(app) as (_, kit):
        await produce(acl_cluster, "identity", IDENTITY, signed_payload(grant))

        async def applied() -> bool:
            async with kit.sessions() as session:
                return await iam.is_platform_admin(session, Principal(subject=grant.data.user_id, kind="user"))

        await wait_for(applied, 60, "the identity event over SASL")

    from aiokafka import AIOKafkaConsumer

    thief = AIOKafkaConsumer(
        IDENTITY,
        bootstrap_servers=acl_cluster.sasl_bootstrap,
        group_id="billing",
        **security(acl_cluster, "allocations"),
    )
    try:
        with pytest.raises(GroupAuthorizationFailedError):
            await asyncio.wait_for(thief.start(), 30)  # refused as it joins
            await asyncio.wait_for(thief.getmany(timeout_ms=5000), 30)
    finally:
        await thief.stop()
