"""Postgres and Apache Kafka as containers, started with testcontainers through podman's Docker-compatible API.

`GPUAAS_STACK_BROKER=testcontainers` (`make test-containers`): the test stacks' Postgres and Apache Kafka run from
the images of deploy/images/infra (`localhost/gpuaas-postgres:15`, `localhost/gpuaas-kafka:<version>`, built by
`make infra-images`) instead of as processes. No Docker engine here: `PodmanService` runs
`podman system service` on a socket of its own and points DOCKER_HOST at it (unless DOCKER_HOST is already set);
the reaper (Ryuk) image cannot be pulled, so it is disabled and whatever is started here is removed here.

    with PodmanService(root / "podman.sock"):          # the Docker API for testcontainers
        pg = start_postgres("gpuaas-tc-pg-1", password)  # ready; pg.url is the superuser's URL
        broker = ContainerKafka(root / "kafka", port=free_port())
        broker.start()            # create + start the container, wait until it serves metadata
        broker.stop()             # `podman stop`: controlled shutdown; start() again keeps the log
        broker.kill()             # SIGKILL; the next start recovers the log
        broker.remove(); pg.stop()

`ContainerKafka` has `ApacheKafka`'s interface, so a Stack with `broker="testcontainers"` stops, kills and
restarts it the way it does the process-run broker (the e2e "broker stop/start keeps the log" tests run on it).
Containers are named `gpuaas-tc-…` and labelled `gpuaas.devstack.root=<the stack's directory>`.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from gpuaas.devstack.infra import free_port, stop_process
from gpuaas.devstack.infra_images import KAFKA_IMAGE, POSTGRES_IMAGE
from gpuaas.devstack.kafka import KAFKA_VERSION, KafkaError, _cluster_id, wait_serving
from gpuaas.devstack.runtime_images import podman_env

if TYPE_CHECKING:
    from testcontainers.core.container import DockerContainer

log = logging.getLogger("gpuaas.devstack")
NAME_PREFIX = "gpuaas-tc"
STARTUP_TIMEOUT_S = 300  # each container's; under load (8 test sessions on 2 cores) a JVM start took ~2 min
ROOT_LABEL = "gpuaas.devstack.root"
# A test broker: C1 only (starts faster), a small heap.
TEST_KAFKA_JVM = "-XX:+UseG1GC -XX:TieredStopAtLevel=1 -XX:+ExitOnOutOfMemoryError"
# The embedded Postgres's settings (infra.EmbeddedPostgres): many service connections, no durability needed.
TEST_POSTGRES_ARGS = (
    "-c max_connections=300 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c shared_buffers=128MB"
)


def _testcontainers_env() -> None:
    # The reaper image cannot be pulled (no public registry); the fixtures remove what they start.
    os.environ["TESTCONTAINERS_RYUK_DISABLED"] = "true"
    # testcontainers' waits default to 120 s; a loaded 2-core machine has needed more for initdb.
    os.environ.setdefault("TC_MAX_TRIES", str(STARTUP_TIMEOUT_S))


class PodmanService:
    """`podman system service --time=0 unix://<socket>` for the session, DOCKER_HOST pointing at it; stopped
    (and DOCKER_HOST restored) on exit. With DOCKER_HOST already set (an engine, or a service the caller
    runs), nothing is started."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._previous: str | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def __enter__(self) -> PodmanService:
        _testcontainers_env()
        if os.environ.get("DOCKER_HOST"):
            log.info("testcontainers: using DOCKER_HOST=%s", os.environ["DOCKER_HOST"])
            return self
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        log_file = open(self.socket_path.with_suffix(".log"), "ab")
        try:
            self.proc = subprocess.Popen(
                ["podman", "system", "service", "--time=0", self.url],
                env=podman_env(),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log_file.close()
        self._previous = os.environ.get("DOCKER_HOST")
        os.environ["DOCKER_HOST"] = self.url
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        import docker

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"podman system service exited with {self.proc.returncode}: see {self.socket_path}.log"
                )
            if self.socket_path.exists():
                with suppress(Exception):
                    client = docker.DockerClient(base_url=self.url, timeout=5)
                    try:
                        if client.ping():
                            return
                    finally:
                        client.close()
            time.sleep(0.1)
        raise TimeoutError(f"podman's Docker API on {self.url} did not answer within {timeout_s:.0f}s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        stop_process(self.proc)
        self.proc = None
        if self._previous is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = self._previous
        self.socket_path.unlink(missing_ok=True)


def _publish_on_loopback(container: DockerContainer, port: int, host_port: int) -> None:
    # testcontainers' with_bind_ports binds every interface; docker-py takes (ip, port) for one.
    ports = cast(dict[str, object], container.ports)  # typed as port -> port; docker-py also takes (ip, port)
    ports[f"{port}/tcp"] = ("127.0.0.1", host_port)


@dataclass
class PostgresHandle:
    container: Any  # testcontainers' PostgresContainer
    url: str  # the superuser's URL (postgresql://postgres:…@127.0.0.1:<port>/<dbname>)
    seconds: float  # from create to accepting queries

    def stop(self) -> None:
        with suppress(Exception):
            self.container.stop()


def start_postgres(
    name: str, password: str, *, dbname: str = "postgres", labels: dict[str, str] | None = None
) -> PostgresHandle:
    """A Postgres container on a loopback port, ready (testcontainers waits until `psql` answers in it)."""
    _testcontainers_env()
    from testcontainers.community.postgres import PostgresContainer
    from testcontainers.core.config import testcontainers_config

    testcontainers_config.max_tries = max(testcontainers_config.max_tries, STARTUP_TIMEOUT_S)

    t0 = time.monotonic()
    port = free_port()
    pg = PostgresContainer(POSTGRES_IMAGE, username="postgres", password=password, dbname=dbname, driver=None)
    pg.with_name(name).with_command(TEST_POSTGRES_ARGS).with_kwargs(labels=labels or {})
    _publish_on_loopback(pg, 5432, port)
    try:
        pg.start()
    except BaseException:
        with suppress(Exception):
            pg.stop()
        raise
    url = f"postgresql://postgres:{password}@127.0.0.1:{port}/{dbname}"
    return PostgresHandle(pg, url, time.monotonic() - t0)


@dataclass
class ContainerKafka:
    """Apache Kafka (one KRaft node) in a container on a loopback port, with `ApacheKafka`'s interface: the
    container is created at the first start() and kept until remove(), so stop()/start() keep the log."""

    data_dir: Path  # holds nothing of the broker's: its log is in the container; kafka.log is copied here
    port: int = 9092
    host: str = "127.0.0.1"
    log_path: Path | None = None
    version: str = KAFKA_VERSION
    heap: str = "512m"
    image: str = KAFKA_IMAGE
    labels: dict[str, str] = field(default_factory=dict)
    proc: None = field(default=None, init=False)  # no local process: supervision's reap_group() is a no-op
    started_at: float = field(default=0.0, init=False)
    container: Any = field(default=None, init=False)  # testcontainers' DockerContainer once created

    @property
    def name(self) -> str:
        return f"{NAME_PREFIX}-kafka-{self.data_dir.parent.name}-{self.port}"

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_dir(self) -> str:
        return f"{self.name}:/var/lib/kafka/data"

    def _state(self) -> dict[str, Any]:
        if self.container is None:
            return {}
        try:
            wrapped = self.container.get_wrapped_container()
            wrapped.reload()
            return dict(wrapped.attrs.get("State") or {})
        except Exception:
            return {}

    @property
    def running(self) -> bool:
        return bool(self._state().get("Running"))

    @property
    def pid(self) -> int | None:
        pid = self._state().get("Pid")
        return int(pid) if pid else None

    def _create_and_start(self) -> None:
        _testcontainers_env()
        from testcontainers.core.container import DockerContainer

        c = DockerContainer(self.image).with_name(self.name)
        c.with_envs(
            CLUSTER_ID=_cluster_id(),
            KAFKA_ADVERTISED_LISTENERS=f"PLAINTEXT://{self.bootstrap}",
            KAFKA_HEAP_OPTS=f"-Xms{self.heap} -Xmx{self.heap}",
            KAFKA_JVM_PERFORMANCE_OPTS=TEST_KAFKA_JVM,
            KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS="8",
        )
        c.with_kwargs(labels={ROOT_LABEL: str(self.data_dir.parent), **self.labels})
        _publish_on_loopback(c, 9092, self.port)
        self.container = c
        c.start()

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Create and start the container the first time, `podman start` it after a stop; wait until it
        serves metadata."""
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        if self.container is None:
            self._create_and_start()
        else:
            self.container.get_wrapped_container().start()
        try:
            wait_serving(self.bootstrap, timeout_s)
        except BaseException:
            self._save_log()
            raise KafkaError(f"the Kafka container {self.name} did not serve on {self.bootstrap}") from None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> None:
        """SIGTERM: `podman stop` (controlled shutdown, the log is kept); SIGKILL: a crash. The container stays."""
        if self.container is None:
            return
        wrapped = self.container.get_wrapped_container()
        with suppress(Exception):
            if sig == signal.SIGKILL:
                wrapped.kill(signal="SIGKILL")
            else:
                wrapped.stop(timeout=int(timeout_s))
        deadline = time.monotonic() + timeout_s
        while self.running and time.monotonic() < deadline:
            time.sleep(0.1)
        self._save_log()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def _save_log(self) -> None:
        if self.log_path is None or self.container is None:
            return
        with suppress(Exception):
            self.log_path.write_bytes(self.container.get_wrapped_container().logs())

    def remove(self) -> None:
        """Remove the container (and its log): the end of a test stack."""
        if self.container is None:
            return
        self._save_log()
        with suppress(Exception):
            self.container.stop()  # testcontainers' stop: remove(force=True, v=True)
        self.container = None


def remove_labelled(root: Path) -> list[str]:
    """Remove every container labelled with this stack directory (left by a run that died): their names."""
    from docker import from_env

    client = from_env()
    removed = []
    try:
        for c in client.containers.list(all=True, filters={"label": f"{ROOT_LABEL}={root}"}):
            with suppress(Exception):
                c.remove(force=True, v=True)
                removed.append(c.name)
    finally:
        client.close()
    return removed
