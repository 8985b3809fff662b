"""Broker plumbing shared by the relay and the consumers: topic creation, producer factory.

Topics are created explicitly with their registered partition count: Tansu auto-creates with 4
and cannot add partitions later.
"""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from gpuaas.contracts import TOPICS
from gpuaas.kit.logging import get_logger

log = get_logger(__name__)


async def ensure_topics(
    bootstrap: str, names: list[str] | None = None, timeout_s: float = 30.0, prefix: str = ""
) -> None:
    """Create the registry's topics that are missing ("already exists" counts as success), each named
    `prefix + logical name` on the broker."""
    wanted = [TOPICS[n] for n in (names or list(TOPICS))]
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    await asyncio.wait_for(admin.start(), timeout_s)
    try:
        existing = set(await admin.list_topics())
        new = [
            NewTopic(
                prefix + t.name,
                num_partitions=t.partitions,
                replication_factor=1,
                topic_configs={"cleanup.policy": "compact,delete"} if t.compacted else {},
            )
            for t in wanted
            if prefix + t.name not in existing
        ]
        if new:
            try:
                await admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass
            log.info("topics_created", topics=[t.name for t in new])
    finally:
        await admin.close()


def make_producer(bootstrap: str, max_message_bytes: int) -> AIOKafkaProducer:
    # acks=all; no idempotence/transactions (Tansu cannot do them; exactly-once comes from outbox+inbox).
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=2,
        max_batch_size=256 * 1024,
        max_request_size=max_message_bytes + 64 * 1024,
        request_timeout_ms=15000,
        retry_backoff_ms=200,
    )
