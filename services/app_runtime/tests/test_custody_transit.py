"""Credential custody `transit` against a real OpenBao (this test's own mounts) and the re-wrap job on a real
app-runtime schema: every row moved to the new Transit key version, audited once, resumable after a kill."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
from sqlalchemy import func, insert, select

from gpuaas.app_runtime.app import SPEC
from gpuaas.app_runtime.custody import SchemaCustody, Sealed, TransitCustody
from gpuaas.app_runtime.models import credentials, instances
from gpuaas.app_runtime.rewrap import ACTION, remaining, retire_old_versions, rewrap_credentials
from gpuaas.kit.db import create_engine, session_factory
from gpuaas.kit.errors import Unavailable
from gpuaas.kit.secrets_at_rest import Keyring, generate_key_text
from gpuaas.kit.tables import outbox
from gpuaas.kit.testing import new_service_db
from gpuaas.kit.testing_vault import VaultSandbox
from gpuaas.kit.vault import SecretsUnavailable, TransitKey, VaultClient, VaultConfig

pytestmark = pytest.mark.integration
KEY = "app-runtime"


def _transit(vault: VaultSandbox, config: VaultConfig) -> TransitKey:
    return TransitKey(VaultClient(config), vault.transit, KEY)


def _sealed(row) -> Sealed:
    return Sealed(
        custody=row.custody,
        ciphertext=row.ciphertext,
        nonce=row.nonce,
        wrapped_dek=row.wrapped_dek,
        dek_nonce=row.dek_nonce,
        kek_id=row.kek_id,
    )


class Schema:
    """A fresh, migrated app-runtime schema with one instance and `n` sealed credential rows."""

    def __init__(self, url: str, schema: str) -> None:
        self.url, self.schema = url, schema
        self.engine = create_engine(url, schema, pool_size=2)
        self.sessions = session_factory(self.engine)
        self.keys: dict[uuid.UUID, str] = {}

    async def fill(self, custodies: list[TransitCustody | SchemaCustody], n: int) -> None:
        iid, tenant, project = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
        async with self.sessions() as s, s.begin():
            await s.execute(
                insert(instances).values(
                    instance_id=iid, tenant_id=tenant, project_id=project, name="i", app_slug="a", app_version="1",
                    manifest_id=uuid.uuid4(), artifact_digest="sha256:" + "0" * 64, status="running",
                    placement_intent={}, config={}, version=1,
                )
            )  # fmt: skip
        rows = []
        for i in range(n):
            cid = uuid.uuid4()
            self.keys[cid] = f"private-key-{i}-{uuid.uuid4().hex}"
            sealed = await custodies[i % len(custodies)].seal(cid, self.keys[cid])
            rows.append({
                "credential_id": cid, "instance_id": iid, "tenant_id": tenant, "project_id": project,
                "public_key": "ssh-ed25519 x", "fingerprint": "SHA256:x", "status": "active", "version": 1,
                **sealed.columns(),
            })  # fmt: skip
        async with self.sessions() as s, s.begin():
            await s.execute(insert(credentials), rows)

    async def rows(self):
        async with self.sessions() as s:
            return (await s.execute(select(credentials).order_by(credentials.c.credential_id))).all()

    async def audited(self) -> list[str]:
        async with self.sessions() as s:
            payloads = (await s.execute(select(outbox.c.payload).where(outbox.c.event_type == "audit.recorded"))).all()
        docs = [json.loads(p[0]) for p in payloads]
        return [d["data"]["resource_id"] for d in docs if d["data"]["action"] == ACTION]


@pytest.fixture
async def schema(infra):
    name, url = await new_service_db(infra.admin_url, "app_runtime", SPEC)
    db = Schema(url, name)
    yield db
    await db.engine.dispose()


async def test_transit_custody_round_trip_bound_to_the_credential(vault: VaultSandbox) -> None:
    vault.transit_key(KEY)
    custody = TransitCustody(_transit(vault, vault.approle("ar", vault.service_policy(KEY))))
    cid = uuid.uuid4()
    sealed = await custody.seal(cid, "-----BEGIN OPENSSH PRIVATE KEY----- x")
    assert sealed.kek_id == f"transit:{KEY}:v1" and sealed.wrapped_dek and sealed.wrapped_dek.startswith(b"vault:v1:")
    assert b"OPENSSH" not in (sealed.ciphertext or b"")
    assert await custody.open(cid, sealed) == "-----BEGIN OPENSSH PRIVATE KEY----- x"
    with pytest.raises(SecretsUnavailable):  # the wrapped key moved to another credential row
        await custody.open(uuid.uuid4(), sealed)
    with pytest.raises(Unavailable, match="no keyring configured") as refused:  # a keyring row, no keyring
        await custody.open(cid, Sealed(custody="schema", kek_id="k1", wrapped_dek=b"x", dek_nonce=b"x"))
    assert refused.value.code == "credential_key_unavailable"


async def test_rotation_rewrap_moves_every_row_and_retires_the_old_version(vault: VaultSandbox, schema) -> None:
    """Rows wrapped by the keyring and by Transit v1; rotate to v2; the re-wrap moves all of them (audited
    once each); after retiring v1 every row opens and a v1 copy does not."""
    vault.transit_key(KEY)
    keyring = SchemaCustody(Keyring.parse(generate_key_text("env1")))
    custody = TransitCustody(_transit(vault, vault.approle("ar", vault.service_policy(KEY))), keyring)
    n = 200
    await schema.fill([custody, keyring], n)
    before = {r.credential_id: r for r in await schema.rows()}
    assert vault.rotate(KEY) == 2

    report = await rewrap_credentials(schema.sessions, custody, batch_size=25)
    assert (report.moved, report.skipped, report.target) == (n, 0, f"transit:{KEY}:v2")
    assert await remaining(schema.sessions, report.target) == 0
    assert sorted(await schema.audited()) == sorted(str(c) for c in schema.keys)
    assert (await rewrap_credentials(schema.sessions, custody)).moved == 0  # nothing left: a no-op

    operator = TransitCustody(_transit(vault, vault.token_config()))
    assert await retire_old_versions(schema.sessions, operator) == 2
    only_transit = TransitCustody(custody.transit)  # no keyring: every row must open through Transit v2
    for row in await schema.rows():
        assert row.kek_id == f"transit:{KEY}:v2" and row.dek_nonce is None
        assert row.ciphertext == before[row.credential_id].ciphertext  # the private key was never re-encrypted
        assert await only_transit.open(row.credential_id, _sealed(row)) == schema.keys[row.credential_id]
    old_v1 = next(r for r in before.values() if (r.kek_id or "").endswith(":v1"))
    with pytest.raises(SecretsUnavailable):  # the retired version no longer unwraps
        await only_transit.open(old_v1.credential_id, _sealed(old_v1))


async def test_a_rewrap_killed_midway_resumes_without_loss(vault: VaultSandbox, schema) -> None:
    vault.transit_key(KEY)
    role = vault.approle("ar", vault.service_policy(KEY))
    custody = TransitCustody(_transit(vault, role))
    n = 120
    await schema.fill([custody], n)
    assert vault.rotate(KEY) == 2
    target = f"transit:{KEY}:v2"
    env = {
        **os.environ,
        "GPUAAS_APP_RUNTIME_DATABASE_URL": schema.url,
        "GPUAAS_APP_RUNTIME_DB_SCHEMA": schema.schema,
        "GPUAAS_SECRETS_KEYS": generate_key_text("unused"),
        "GPUAAS_APP_RUNTIME_CREDENTIAL_BACKEND": "transit",
        "GPUAAS_APP_RUNTIME_VAULT_URL": role.url,
        "GPUAAS_APP_RUNTIME_VAULT_ROLE_ID": role.role_id,
        "GPUAAS_APP_RUNTIME_VAULT_SECRET_ID": role.secret_id,
        "GPUAAS_APP_RUNTIME_VAULT_APPROLE_MOUNT": role.approle_mount,
        "GPUAAS_APP_RUNTIME_VAULT_TRANSIT_MOUNT": vault.transit,
        "GPUAAS_APP_RUNTIME_LOG_JSON": "false",
    }
    cmd = [sys.executable, "-m", "gpuaas.app_runtime.rewrap", "--batch-size", "5", "--pause-s", "0.3"]
    job = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        while await remaining(schema.sessions, target) > n - 10:  # two batches committed
            assert job.returncode is None, await job.stdout.read() if job.stdout else ""
            await asyncio.sleep(0.05)
        job.send_signal(signal.SIGKILL)
        await asyncio.wait_for(job.wait(), 10)
    finally:
        if job.returncode is None:
            job.kill()
            await job.wait()
    left = await remaining(schema.sessions, target)
    assert 0 < left < n  # killed in the middle
    moved_before = len(await schema.audited())
    assert moved_before == n - left  # every committed move is audited, nothing half-applied

    report = await rewrap_credentials(schema.sessions, custody, batch_size=7)  # the job run again
    assert report.moved == left and await remaining(schema.sessions, target) == 0
    assert sorted(await schema.audited()) == sorted(str(c) for c in schema.keys)  # each row once
    for row in await schema.rows():
        assert await custody.open(row.credential_id, _sealed(row)) == schema.keys[row.credential_id]


async def test_a_keyring_wrapped_row_cannot_be_moved_without_the_keyring(vault: VaultSandbox, schema) -> None:
    vault.transit_key(KEY)
    keyring = SchemaCustody(Keyring.parse(generate_key_text("env1")))
    await schema.fill([keyring], 3)
    custody = TransitCustody(_transit(vault, vault.token_config()))
    with pytest.raises(RuntimeError, match="the keyring is needed"):
        await rewrap_credentials(schema.sessions, custody)
    async with schema.sessions() as s:
        assert (await s.execute(select(func.count()).where(credentials.c.kek_id == "env1"))).scalar_one() == 3
