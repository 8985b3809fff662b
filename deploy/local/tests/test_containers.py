"""The infrastructure images and the testcontainers route the e2e suite takes with
GPUAAS_STACK_BROKER=testcontainers (`make test-containers`), with real podman: the image build cache, podman's
Docker API started and stopped, Postgres from the image through testcontainers' PostgresContainer (the official
image's POSTGRES_* contract), and the Kafka container's stop/start and SIGKILL keeping its log.
The first run builds the images (~2 min, mmdebstrap); later runs reuse them."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from gpuaas.devstack import infra_images
from gpuaas.devstack.containers import ROOT_LABEL, ContainerKafka, PodmanService, remove_labelled, start_postgres
from gpuaas.devstack.infra import free_port
from gpuaas.devstack.runtime_images import podman_env
from gpuaas.devstack.testing import temp_root

pytestmark = pytest.mark.skipif(
    shutil.which("podman") is None or shutil.which("mmdebstrap") is None,
    reason="podman and mmdebstrap are needed (make install)",
)


def podman(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], env=podman_env(), capture_output=True, text=True)


def labelled(root: Path) -> list[str]:
    r = podman("ps", "-a", "--filter", f"label={ROOT_LABEL}={root}", "--format", "{{.Names}}")
    return r.stdout.split()


def test_images_build_once_then_come_from_the_cache() -> None:
    first = infra_images.ensure_infra_images()
    t0 = time.monotonic()
    again = infra_images.ensure_infra_images()
    assert [i.built for i in again] == ["cached", "cached"]
    assert time.monotonic() - t0 < 10
    assert [i.image_id for i in again] == [i.image_id for i in first]
    refs = {i.ref: i for i in again}
    assert set(refs) == {infra_images.KAFKA_IMAGE, infra_images.POSTGRES_IMAGE}
    for image in again:
        print(f"{image.ref}: {image.size_bytes / 1e6:.0f} MB")
        assert 50e6 < image.size_bytes < 600e6
    # Non-root users, and the JRE and server the images are about.
    r = podman(
        "run", "--rm", "--network=none", "--entrypoint", "sh", infra_images.KAFKA_IMAGE, "-c", "id -u; java -version"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "1000" and 'version "17.' in r.stderr
    r = podman("run", "--rm", "--network=none", infra_images.POSTGRES_IMAGE, "sh", "-c", "id -un; postgres --version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == "postgres" and "(PostgreSQL) 15." in r.stdout


async def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for v in values:
            await producer.send_and_wait(topic, v, partition=0)
    finally:
        await producer.stop()


async def _read_all(bootstrap: str, topic: str) -> list[bytes]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        values: list[bytes] = []
        while len(values) < end:
            batch = await consumer.getmany(tp, timeout_ms=5000)
            if not batch:
                break
            values += [m.value for m in batch.get(tp, []) if m.value is not None]
        return values
    finally:
        await consumer.stop()


def test_testcontainers_postgres_and_kafka_keep_their_data_across_stop_start_and_sigkill() -> None:
    root = temp_root("gpuaas-tc-test-")
    infra_images.ensure_infra_images()
    before = os.environ.get("DOCKER_HOST")
    service = PodmanService(root / "podman.sock")
    try:
        t0 = time.monotonic()
        with service:
            assert os.environ["DOCKER_HOST"].startswith("unix://")
            pg = start_postgres(
                f"gpuaas-tc-pg-{root.name}", "s3cret'pw", dbname="gpuaas_tc", labels={ROOT_LABEL: str(root)}
            )
            broker = ContainerKafka(
                root / "kafka", port=free_port(), log_path=root / "kafka.log", labels={ROOT_LABEL: str(root)}
            )
            t_pg = time.monotonic()
            broker.start()
            ready = time.monotonic() - t0
            print(f"API + Postgres {t_pg - t0:.1f}s, + Kafka serving {ready:.1f}s")
            assert sorted(labelled(root)) == sorted([broker.name, f"gpuaas-tc-pg-{root.name}"])

            async def query() -> tuple[str, str]:
                conn = await asyncpg.connect(pg.url)
                try:
                    row = await conn.fetchrow("SELECT current_user, current_database()")
                    return row[0], row[1]
                finally:
                    await conn.close()

            assert asyncio.run(query()) == ("postgres", "gpuaas_tc")  # POSTGRES_DB was created

            topic = "tc-keeps-log"
            asyncio.run(_produce(broker.bootstrap, topic, [b"a", b"b"]))
            assert broker.running and broker.pid
            broker.stop()  # podman stop: controlled shutdown
            assert not broker.running
            assert not _accepts(broker.host, broker.port)
            broker.start()
            assert asyncio.run(_read_all(broker.bootstrap, topic)) == [b"a", b"b"]
            asyncio.run(_produce(broker.bootstrap, topic, [b"c"]))
            broker.kill()  # a crash: the log is recovered at the next start
            assert not broker.running
            broker.start()
            assert asyncio.run(_read_all(broker.bootstrap, topic)) == [b"a", b"b", b"c"]

            broker.remove()
            assert labelled(root) == [f"gpuaas-tc-pg-{root.name}"]
            assert remove_labelled(root) == [f"gpuaas-tc-pg-{root.name}"]
            assert labelled(root) == []
        assert os.environ.get("DOCKER_HOST") == before
        assert not service.socket_path.exists()
    finally:
        for name in labelled(root):
            podman("rm", "-f", name)
        shutil.rmtree(root, ignore_errors=True)


def _accepts(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0
