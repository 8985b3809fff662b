"""Apache Kafka (4.x, KRaft, one node) on loopback: the second broker of the test matrix.

The broker's jars come from Maven Central through the small pom in `deploy/local/kafka/`
(`mvn -q dependency:copy-dependencies`), cached in `~/.cache/gpuaas/kafka-<version>/` (or
`GPUAAS_KAFKA_CACHE`). The log directory is formatted once (`kafka.tools.StorageTool format`) and
then kept: `stop()` + `start()` is a broker restart that keeps every topic, offset and group —
unlike Tansu, whose memory storage loses everything.

    broker = ApacheKafka(Path(".local/kafka"), port=9092)
    broker.start()          # fetch jars (first time), format (first time), start, wait until it serves
    broker.stop()           # controlled shutdown (SIGTERM); broker.start() again keeps the log
    broker.kill()           # SIGKILL: an unclean stop, the log is recovered at the next start

`python -m gpuaas.devstack.kafka start --dir DIR --port PORT` runs it in the background (pid file in
DIR) for `make test-kafka`; `... stop --dir DIR` stops it.

With `sasl_users` (`--sasl-user NAME=PASSWORD`) it also serves a SASL_PLAINTEXT listener (`sasl_bootstrap`,
mechanism PLAIN, those JAAS users), or SASL_SSL with `tls` (`--tls`: a CA and a server certificate for
127.0.0.1 made with openssl in DIR/tls, the CA at `ca_file`); with `acls` (`--acls`) the StandardAuthorizer
refuses whatever no ACL allows, except to `super_users` (`--super-user NAME`). The PLAINTEXT listener stays
for the broker's own traffic (its principal, ANONYMOUS, is a super user): loopback only, a test broker.
`create_acls` grants.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuaas.devstack.infra import free_port, stop_process, wait_port

POM = Path(__file__).resolve().parents[3] / "kafka" / "pom.xml"
KAFKA_VERSION = "4.1.0"
LOG4J2_CONFIG = """\
Configuration:
  Appenders:
    Console:
      name: STDOUT
      PatternLayout:
        pattern: "[%d] %p %m (%c)%n"
  Loggers:
    Root:
      level: WARN
      AppenderRef:
        - ref: STDOUT
    Logger:
      - name: kafka.server.KafkaServer
        level: INFO
      - name: kafka.server.BrokerServer
        level: INFO
"""


class KafkaError(RuntimeError):
    """The broker could not be fetched, formatted or started; the message says why."""


def cache_dir(version: str = KAFKA_VERSION) -> Path:
    base = os.environ.get("GPUAAS_KAFKA_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "gpuaas" / f"kafka-{version}"


def java_binary() -> str:
    """Java 17+ (JAVA_HOME first, then PATH)."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not java or not Path(java).exists():
        raise KafkaError("Apache Kafka needs Java 17: install openjdk-17-jre-headless (make install does)")
    return java


def ensure_jars(version: str = KAFKA_VERSION, pom: Path = POM) -> Path:
    """The directory holding the broker's jars; fetched from Maven Central once, then cached."""
    target = cache_dir(version)
    marker = target / ".complete"
    if marker.exists():
        return target
    mvn = shutil.which("mvn")
    if not mvn:
        raise KafkaError("fetching Apache Kafka needs Maven: install maven (make install does)")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [
        mvn,
        "-q",
        "-B",
        "-f",
        str(pom),
        f"-Dkafka.version={version}",
        "dependency:copy-dependencies",
        f"-DoutputDirectory={tmp}",
        "-DincludeScope=runtime",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not any(tmp.glob("kafka_2.13-*.jar")):
        shutil.rmtree(tmp, ignore_errors=True)
        out = result.stdout + result.stderr
        raise KafkaError(f"mvn dependency:copy-dependencies failed ({result.returncode}):\n{out}")
    (tmp / ".complete").write_text(version + "\n")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, target)  # atomic; a concurrent fetch that won leaves ours behind
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not marker.exists():
            raise
    return target


def _cluster_id() -> str:
    # Kafka's own form (22 base64url chars). Passed as `--cluster-id=<id>`: an id starting with "-" would
    # otherwise be read by the tool's argument parser as an option (1 in 32 formats failed that way).
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


@dataclass
class ApacheKafka:
    """One KRaft node (broker + controller) on loopback whose log survives stop/start."""

    data_dir: Path
    port: int = 9092
    host: str = "127.0.0.1"
    log_path: Path | None = None
    version: str = KAFKA_VERSION
    heap: str = "512m"
    # SASL_PLAINTEXT listener (PLAIN) with these users (name -> password) on `sasl_port` (0: a free port).
    sasl_users: dict[str, str] = field(default_factory=dict)
    sasl_port: int = 0
    # That listener over TLS (SASL_SSL), with a certificate from a CA of its own (`ca_file`).
    tls: bool = False
    # The StandardAuthorizer: only ACLs (and these super users, besides the broker's own) allow anything.
    acls: bool = False
    super_users: tuple[str, ...] = ()
    proc: subprocess.Popen | None = field(default=None, init=False)
    started_at: float = field(default=0.0, init=False)
    controller_port: int = field(default=0, init=False)

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def sasl_bootstrap(self) -> str:
        if not self.sasl_users:
            raise KafkaError("this broker has no SASL listener (sasl_users)")
        return f"{self.host}:{self.sasl_port}"

    @property
    def sasl_protocol(self) -> str:
        return "SASL_SSL" if self.tls else "SASL_PLAINTEXT"

    @property
    def ca_file(self) -> Path:
        return self.data_dir / "tls" / "ca.crt"

    def _make_certificates(self) -> None:
        """A CA and a certificate for the host (PKCS#8 key + certificate in one PEM keystore), once."""
        tls = self.ca_file.parent
        if (tls / "keystore.pem").exists():
            return
        openssl = shutil.which("openssl")
        if not openssl:
            raise KafkaError("a TLS listener needs the openssl command")
        tls.mkdir(parents=True, exist_ok=True)
        (tls / "ext.cnf").write_text(f"subjectAltName=IP:{self.host},DNS:localhost\n")
        steps = [
            ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "30",
             "-subj", "/CN=gpuaas-devstack-ca"],
            ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", f"/CN={self.host}"],
            ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "30", "-extfile", "ext.cnf"],
            ["pkcs8", "-topk8", "-nocrypt", "-in", "server.key", "-out", "server.pk8"],
        ]  # fmt: skip
        for step in steps:
            result = subprocess.run([openssl, *step], cwd=tls, capture_output=True, text=True)
            if result.returncode != 0:
                raise KafkaError(f"openssl {step[0]} failed: {result.stderr}")
        (tls / "keystore.pem").write_text((tls / "server.pk8").read_text() + (tls / "server.crt").read_text())

    @property
    def config_path(self) -> Path:
        return self.data_dir / "server.properties"

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "log"

    @property
    def formatted(self) -> bool:
        return (self.log_dir / "meta.properties").exists()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _security_properties(self) -> list[str]:
        lines = []
        if self.sasl_users:
            users = " ".join(f'user_{name}="{password}"' for name, password in self.sasl_users.items())
            jaas = f"org.apache.kafka.common.security.plain.PlainLoginModule required {users};"
            listener = self.sasl_protocol.lower()
            lines += ["sasl.enabled.mechanisms=PLAIN", f"listener.name.{listener}.plain.sasl.jaas.config={jaas}"]
        if self.tls:
            keystore = self.ca_file.parent / "keystore.pem"
            lines += ["ssl.keystore.type=PEM", f"ssl.keystore.location={keystore}", "ssl.client.auth=none"]
        if self.acls:
            supers = ";".join(f"User:{u}" for u in ("ANONYMOUS", *self.super_users))
            lines += [
                "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                f"super.users={supers}",
            ]
        return lines

    def _properties(self) -> str:
        sasl = f"{self.sasl_protocol}://{self.host}:{self.sasl_port}," if self.sasl_users else ""
        return "\n".join(
            [
                "process.roles=broker,controller",
                "node.id=1",
                f"controller.quorum.voters=1@{self.host}:{self.controller_port}",
                f"listeners={sasl}PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}",
                f"advertised.listeners={sasl}PLAINTEXT://{self.host}:{self.port}",
                "controller.listener.names=CONTROLLER",
                "inter.broker.listener.name=PLAINTEXT",
                "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,"
                "SASL_PLAINTEXT:SASL_PLAINTEXT,SASL_SSL:SASL_SSL",
                *self._security_properties(),
                f"log.dirs={self.log_dir}",
                "num.partitions=4",
                "offsets.topic.replication.factor=1",
                "offsets.topic.num.partitions=8",
                "transaction.state.log.replication.factor=1",
                "transaction.state.log.min.isr=1",
                "share.coordinator.state.topic.replication.factor=1",
                "share.coordinator.state.topic.min.isr=1",
                # Tests: a group's first join is not held back waiting for more members.
                "group.initial.rebalance.delay.ms=0",
                # The services enforce ~1 MB; the broker refuses anything above this (bad-input tests).
                "message.max.bytes=2097152",
                "log.retention.hours=168",
                "log.segment.bytes=67108864",
                "auto.create.topics.enable=true",
                "",
            ]
        )

    def _java(self, main: str, *args: str, **popen: object) -> list[str]:
        jars = ensure_jars(self.version)
        log4j = self.data_dir / "log4j2.yaml"
        if not log4j.exists():
            log4j.write_text(LOG4J2_CONFIG)
        return [
            java_binary(),
            f"-Xms{self.heap}",
            f"-Xmx{self.heap}",
            "-XX:+UseG1GC",
            "-XX:TieredStopAtLevel=1",  # C1 only: faster start, plenty for a test broker
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={log4j}",
            f"-Dkafka.logs.dir={self.data_dir / 'logs'}",
            "-cp",
            f"{jars}/*",
            main,
            *args,
        ]

    def format(self) -> None:
        """Write the config and format the log directory (once; a formatted directory is kept)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.sasl_users and not self.sasl_port:
            self.sasl_port = free_port(self.host)
        if self.tls:
            self._make_certificates()
        if self.formatted:
            self._read_controller_port()
            return
        if not self.controller_port:
            self.controller_port = free_port(self.host)
        self.config_path.write_text(self._properties())
        cmd = self._java(
            "kafka.tools.StorageTool", "format", f"--cluster-id={_cluster_id()}", "--config", str(self.config_path)
        )
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise KafkaError(f"kafka-storage format failed ({result.returncode}):\n{result.stdout}{result.stderr}")

    def _read_controller_port(self) -> None:
        for line in self.config_path.read_text().splitlines():
            if line.startswith("controller.quorum.voters="):
                self.controller_port = int(line.rsplit(":", 1)[1])
        # The listener port may differ from the one formatted with (a new run's free port): rewrite.
        self.config_path.write_text(self._properties())

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the broker (formatting first if needed) and wait until it serves metadata."""
        if self.running:
            return
        self.format()
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.started_at = time.time()
        try:
            self.proc = subprocess.Popen(
                self._java("kafka.Kafka", str(self.config_path)),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            if not isinstance(log, int):
                log.close()
        try:
            wait_port(self.host, self.port, timeout_s, self.proc)
            if self.sasl_users:
                wait_port(self.host, self.sasl_port, timeout_s, self.proc)
            wait_serving(self.bootstrap, max(timeout_s - (time.time() - self.started_at), 5.0), self.proc)
        except BaseException:
            self.stop(signal.SIGKILL)
            raise

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> None:
        """Controlled shutdown (SIGTERM): the broker flushes and closes its log; the log is kept."""
        stop_process(self.proc, sig, timeout_s)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the next start recovers the log (unflushed tail segments are truncated)."""
        self.stop(signal.SIGKILL)


def wait_serving(bootstrap: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until the broker answers a metadata request with itself as a live broker."""

    async def probe() -> bool:
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
        try:
            await asyncio.wait_for(admin.start(), 5)
            cluster = await asyncio.wait_for(admin.describe_cluster(), 5)
            return bool(cluster.get("brokers"))
        except Exception:
            return False
        finally:
            try:
                await admin.close()
            except Exception:
                pass

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise KafkaError(f"Apache Kafka exited with {proc.returncode} before serving on {bootstrap}")
        if asyncio.run(probe()):
            return
        time.sleep(0.3)
    raise TimeoutError(f"Apache Kafka on {bootstrap} did not serve metadata within {timeout_s:.0f}s")


# Kafka's protocol codes (org.apache.kafka.common.resource / acl): resource types, operations.
ACL_RESOURCES = {"topic": 2, "group": 3, "cluster": 4}
ACL_OPERATIONS = {"all": 2, "read": 3, "write": 4, "create": 5, "describe": 8, "describe_configs": 10}
_PATTERN = {"literal": 3, "prefixed": 4}
_ALLOW = 3


async def create_acls(
    bootstrap: str, principal: str, grants: list[tuple[str, str, str]], *, pattern: str = "prefixed"
) -> None:
    """Allow `principal` (`User:NAME`) each (resource type, resource name, operation) of `grants`, e.g.
    `("topic", "prod.", "write")`: names are prefixes unless `pattern="literal"`. Sent on the PLAINTEXT
    listener (`bootstrap`), whose principal is a super user. (aiokafka's admin client has no ACL call: the
    CreateAcls request is sent as is.)"""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import for_code
    from aiokafka.protocol.admin import CreateAclsRequest

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    await admin.start()
    try:
        for resource, name, operation in grants:
            request = CreateAclsRequest(
                ACL_RESOURCES[resource], name, _PATTERN[pattern], principal, "*", ACL_OPERATIONS[operation], _ALLOW
            )
            response: Any = await admin._send_request(request)  # a CreateAclsResponse (aiokafka types a Response)
            for result in response.creation_responses:
                if result[0]:
                    raise for_code(result[0])(f"ACL {principal} {operation} {resource} {name}: {result[1]}")
    finally:
        await admin.close()


# ---------------------------------------------------------------------------------------------- CLI


def _pidfile(data_dir: Path) -> Path:
    return data_dir / "kafka.pid"


def _cmd_start(args: argparse.Namespace) -> int:
    data_dir = Path(args.dir).absolute()
    if args.fresh:
        shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    users = dict(u.split("=", 1) for u in args.sasl_user)
    broker = ApacheKafka(
        data_dir,
        port=args.port,
        log_path=data_dir / "kafka.log",
        sasl_users=users,
        sasl_port=args.sasl_port,
        acls=args.acls,
        super_users=tuple(args.super_user),
        tls=args.tls,
    )
    t0 = time.monotonic()
    broker.start(timeout_s=args.timeout)
    assert broker.proc is not None
    _pidfile(data_dir).write_text(f"{broker.proc.pid}\n")
    print(
        f"Apache Kafka {broker.version} serving on {broker.bootstrap} in {time.monotonic() - t0:.1f}s "
        f"(pid {broker.proc.pid}, log {data_dir / 'kafka.log'})"
        + (f"; {broker.sasl_protocol} (PLAIN) on {broker.sasl_bootstrap}" if users else "")
        + (f", CA {broker.ca_file}" if args.tls else "")
        + ("; ACLs enforced" if args.acls else ""),
        file=sys.stderr,
    )
    print(broker.bootstrap)
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    data_dir = Path(args.dir).absolute()
    pidfile = _pidfile(data_dir)
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        print(f"no broker recorded in {pidfile}", file=sys.stderr)
        return 0
    import psutil

    try:
        proc = psutil.Process(pid)
        if "java" not in proc.name() or "kafka.Kafka" not in " ".join(proc.cmdline()):
            raise psutil.NoSuchProcess(pid)
        os.killpg(pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except psutil.TimeoutExpired:
            os.killpg(pid, signal.SIGKILL)
            proc.wait(10)
    except psutil.Error:
        pass
    pidfile.unlink(missing_ok=True)
    if args.remove:
        shutil.rmtree(data_dir, ignore_errors=True)
    return 0


def _cmd_fetch(args: argparse.Namespace) -> int:
    print(ensure_jars())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuaas.devstack.kafka", description=(__doc__ or "").splitlines()[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("start", help="start a broker in the background; prints its bootstrap address")
    p.add_argument("--dir", required=True)
    p.add_argument("--port", type=int, default=0, help="0: a free loopback port")
    p.add_argument("--fresh", action="store_true", help="delete the directory first (an empty broker)")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--sasl-user", action="append", default=[], metavar="NAME=PASSWORD", help="a SASL/PLAIN user")
    p.add_argument("--sasl-port", type=int, default=0, help="the SASL_PLAINTEXT listener (0: a free port)")
    p.add_argument("--tls", action="store_true", help="SASL_SSL instead of SASL_PLAINTEXT (CA in DIR/tls/ca.crt)")
    p.add_argument("--acls", action="store_true", help="enforce ACLs (StandardAuthorizer)")
    p.add_argument("--super-user", action="append", default=[], metavar="NAME", help="allowed everything")
    p.set_defaults(func=_cmd_start)
    p = sub.add_parser("stop", help="stop the broker recorded in DIR/kafka.pid")
    p.add_argument("--dir", required=True)
    p.add_argument("--remove", action="store_true", help="delete the directory afterwards")
    p.set_defaults(func=_cmd_stop)
    p = sub.add_parser("fetch", help="download the jars into the cache (Maven Central) and print where")
    p.set_defaults(func=_cmd_fetch)
    args = parser.parse_args(argv)
    if getattr(args, "port", None) == 0:
        args.port = free_port()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
