"""Broker plumbing shared by the relay and the consumers: topic creation, producer factory, and the
connection security every client of the kit uses (`client_security`).

Topics are created explicitly with their registered partition count: Tansu auto-creates with 4
and cannot add partitions later.

Every aiokafka client the kit builds (the producer, the consumers, the topic admin) takes
`**client_security(settings)`: TLS (`ssl_context` from the CA and client certificate files) and SASL
(PLAIN, SCRAM-SHA-256/512) from the `GPUAAS_KAFKA_SECURITY_PROTOCOL`, `GPUAAS_KAFKA_SASL_*` and
`GPUAAS_KAFKA_SSL_*` settings. With the default PLAINTEXT it is empty, so the clients are built as before.
"""

# aiokafka ships no type information (no stubs to find); what this module exports is annotated.
# pyright: reportMissingTypeStubs=false
from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from gpuaas.contracts import TOPICS
from gpuaas.kit.logging import get_logger

if TYPE_CHECKING:
    from gpuaas.kit.settings import ServiceSettings

log = get_logger(__name__)


def client_security(settings: ServiceSettings) -> dict[str, Any]:
    """The aiokafka keyword arguments for the configured security protocol (empty for PLAINTEXT): pass them to
    every AIOKafkaProducer, AIOKafkaConsumer and AIOKafkaAdminClient."""
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return {}
    options: dict[str, Any] = {"security_protocol": protocol}
    if protocol.startswith("SASL_"):
        options |= {
            "sasl_mechanism": settings.kafka_sasl_mechanism,
            "sasl_plain_username": settings.kafka_sasl_username,
            "sasl_plain_password": settings.kafka_sasl_password.get_secret_value(),
        }
    if protocol.endswith("SSL"):
        from aiokafka.helpers import create_ssl_context

        # Verifies the broker's certificate and host name (against the CA file, else the system CAs).
        options["ssl_context"] = create_ssl_context(
            cafile=settings.kafka_ssl_cafile or None,
            certfile=settings.kafka_ssl_certfile or None,
            keyfile=settings.kafka_ssl_keyfile or None,
        )
    return options


async def ensure_topics(
    bootstrap: str,
    names: list[str] | None = None,
    timeout_s: float = 30.0,
    prefix: str = "",
    *,
    security: Mapping[str, Any] | None = None,
    replication_factor: int = 1,
    min_insync_replicas: int = 0,
) -> None:
    """Create the registry's topics that are missing ("already exists" counts as success), each named
    `prefix + logical name` on the broker, with `replication_factor` replicas and, when above 0,
    `min.insync.replicas`. An existing topic is left as it is."""
    wanted = [TOPICS[n] for n in (names or list(TOPICS))]
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000), **(security or {})
    )
    await asyncio.wait_for(admin.start(), timeout_s)
    try:
        existing = set(await admin.list_topics())
        common = {"min.insync.replicas": str(min_insync_replicas)} if min_insync_replicas > 0 else {}
        new = [
            NewTopic(
                prefix + t.name,
                num_partitions=t.partitions,
                replication_factor=replication_factor,
                topic_configs={"cleanup.policy": "compact,delete", **common} if t.compacted else dict(common),
            )
            for t in wanted
            if prefix + t.name not in existing
        ]
        if new:
            try:
                response = await admin.create_topics(new)
            except TopicAlreadyExistsError:
                response = None
            _raise_topic_errors(response)
            log.info("topics_created", topics=[t.name for t in new])
    finally:
        await admin.close()


def _raise_topic_errors(response: Any) -> None:
    """aiokafka returns per-topic errors in the CreateTopics response instead of raising them: raise the
    first one other than "already exists" (a concurrent replica created it), e.g. a replication factor larger
    than the cluster or a topic the principal may not create."""
    if response is None:
        return
    from aiokafka.errors import for_code

    for topic_error in getattr(response, "topic_errors", []):
        name, code = topic_error[0], topic_error[1]
        if code and for_code(code) is not TopicAlreadyExistsError:
            message = topic_error[2] if len(topic_error) > 2 else ""
            raise for_code(code)(f"creating topic {name}: {message or for_code(code).__name__}")


def make_producer(
    bootstrap: str, max_message_bytes: int, security: Mapping[str, Any] | None = None
) -> AIOKafkaProducer:
    # acks=all; no idempotence/transactions (Tansu cannot do them; exactly-once comes from outbox+inbox).
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=2,
        max_batch_size=256 * 1024,
        max_request_size=max_message_bytes + 64 * 1024,
        request_timeout_ms=15000,
        retry_backoff_ms=200,
        **(security or {}),
    )
