"""App-runtime with every key from a real OpenBao (raft-backed, so it can be sealed, stopped and restarted):
the keyring unwrapped by Transit and the event-signing key read from KV at start (and followed on rotation),
credential custody `vault` through AppRole with the committed policy. Vault sealed, stopped or the token
revoked: the caller gets a 503 problem+json (`secrets_unavailable`), nothing is recorded, and the same
service works again once the server is back."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import asyncssh
import pytest
from sqlalchemy import text

from gpuaas.app_runtime.app import SPEC
from gpuaas.app_runtime.custody import VaultCustody
from gpuaas.app_runtime.runtime import AppRuntimeState
from gpuaas.devstack.infra import OpenBao, free_port
from gpuaas.kit.event_signing import generate_seed, key_id, public_of
from gpuaas.kit.testing import service_app
from gpuaas.kit.testing_vault import VaultSandbox
from gpuaas.kit.vault import TransitKey, VaultClient
from gpuaas.kit.vault_keys import wrap_new_key
from gpuaas.sdk import ApiError
from gpuaas.sdk.models import PlacementIntent

from .conftest import Runtime, World, serving

pytestmark = pytest.mark.integration
SERVICE = "app-runtime"


@pytest.fixture(scope="module")
def bao(tmp_path_factory: pytest.TempPathFactory):
    server = OpenBao(tmp_path_factory.mktemp("bao"), port=free_port(), dev=False)
    server.start()
    server.init()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def box(bao: OpenBao):
    sandbox = VaultSandbox.create(bao.url, bao.root_token)
    sandbox.transit_key(SERVICE)
    transit = TransitKey(VaultClient(sandbox.token_config()), sandbox.transit, SERVICE)
    sandbox.put(f"{SERVICE}/secrets-keys", keys=wrap_new_key("", transit, SERVICE, "vk1"))
    sandbox.put(f"{SERVICE}/event-signing", seed=generate_seed())
    return sandbox


@pytest.fixture(scope="module")
async def rt(infra, signer, box: VaultSandbox) -> AsyncIterator[Runtime]:
    """This module's app-runtime: keys and custody in OpenBao (overrides the conftest's `rt`)."""
    role = box.approle("gpuaas-app-runtime", box.service_policy(SERVICE), token_ttl="3s", token_max_ttl="1h")
    app = await service_app(
        SPEC,
        infra.admin_url,
        infra.kafka_bootstrap,
        reconcile_interval_s=0.5,
        lease_default_s=10,
        secrets_key_source="vault",
        secrets_keys="",  # nothing from the environment: the keyring must come from Vault
        event_signing_key="",
        credential_backend="vault",
        vault_url=role.url,
        vault_role_id=role.role_id,
        vault_secret_id=role.secret_id,
        vault_approle_mount=role.approle_mount,
        vault_kv_mount=box.kv,
        vault_transit_mount=box.transit,
        vault_mount=box.kv,
        vault_path_prefix=f"{SERVICE}/credentials",
        vault_refresh_interval_s=0.2,
    )
    async with serving(app, signer) as runtime:
        yield runtime


async def _deploy(w: World) -> uuid.UUID:
    allocs = [await w.allocation() for _ in range(2)]
    inst = await w.user(w.admin).deploy(
        w.project,
        name="hpc",
        app_slug=w.slug,
        config={"partition": "gpu"},
        placement=PlacementIntent(mode="split", controller_allocation_id=allocs[0], worker_allocation_ids=allocs[1:]),
    )
    return inst.instance_id


async def _counts(rt: Runtime) -> tuple[int, int]:
    async with rt.kit.sessions() as s:
        row = (
            await s.execute(text("SELECT (SELECT count(*) FROM instances), (SELECT count(*) FROM credentials)"))
        ).one()
    return int(row[0]), int(row[1])


async def _refused(coro) -> ApiError:
    with pytest.raises(ApiError) as err:
        await coro
    assert (err.value.status, err.value.code) == (503, "secrets_unavailable"), err.value.problem
    assert err.value.problem["type"].endswith("/secrets_unavailable")
    return err.value


async def _fetch_works(w: World, instance_id: uuid.UUID) -> None:
    secret = await w.controller().fetch_credential(instance_id)
    public = asyncssh.import_private_key(secret.private_key).export_public_key().decode().strip()
    assert public == secret.public_key


async def test_keys_come_from_vault_and_the_credential_round_trip_uses_it(rt: Runtime, world: World, box) -> None:
    kit = rt.kit
    assert kit.keyring is not None and kit.keyring.primary == "vk1"  # unwrapped by Transit at start
    seed = box.root.secrets.kv.v2.read_secret_version(
        path=f"{SERVICE}/event-signing", mount_point=box.kv, raise_on_deleted_version=True
    )
    first = seed["data"]["data"]["seed"]
    assert kit.event_signer is not None and kit.event_signer.kid == _kid(first)

    instance_id = await _deploy(world)
    await world.user(world.admin).bind_controller(world.project, world.slug, world.sa)
    async with kit.sessions() as s:
        custody, ciphertext, path = (
            await s.execute(
                text("SELECT custody, ciphertext, vault_path FROM credentials WHERE instance_id = :i"),
                {"i": instance_id},
            )
        ).one()
    assert custody == "vault" and ciphertext is None and path.startswith(f"{SERVICE}/credentials/")
    stored = box.root.secrets.kv.v2.read_secret_version(path=path, mount_point=box.kv, raise_on_deleted_version=True)
    stored = stored["data"]["data"]
    assert "OPENSSH PRIVATE KEY" in stored["private_key"]
    await _fetch_works(world, instance_id)

    # A rotation of the signing key in KV is followed without a restart.
    new = generate_seed()
    box.put(f"{SERVICE}/event-signing", seed=new)
    deadline = time.monotonic() + 20
    while kit.event_signer.kid != _kid(new):
        assert time.monotonic() < deadline, "the new signing key was not picked up"
        await asyncio.sleep(0.1)


def _kid(seed: str) -> str:
    import base64

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    return key_id(Ed25519PublicKey.from_public_bytes(base64.b64decode(public_of(seed))))


async def test_sealed_stopped_or_revoked_vault_fails_cleanly_and_recovers(
    rt: Runtime, world: World, bao: OpenBao, box: VaultSandbox
) -> None:
    instance_id = await _deploy(world)
    await world.user(world.admin).bind_controller(world.project, world.slug, world.sa)
    await _fetch_works(world, instance_id)
    custody = rt.kit.state_as(AppRuntimeState).custody
    assert isinstance(custody, VaultCustody)

    # Sealed: a deploy (which stores a new credential) and the controller's fetch both fail cleanly.
    bao.seal()
    before = await _counts(rt)
    problem = await _refused(_deploy(world))
    assert "sealed" in problem.problem["detail"]
    await _refused(world.controller().fetch_credential(instance_id))
    assert await _counts(rt) == before  # nothing half-written: no instance, no credential row
    bao.unseal()
    await _fetch_works(world, instance_id)
    await _deploy(world)

    # Stopped for longer than the service's token TTL (3 s), then restarted (sealed) and unsealed.
    bao.stop()
    down_until = time.monotonic() + 4.0
    before = await _counts(rt)
    while time.monotonic() < down_until:
        problem = await _refused(_deploy(world))
        assert "unreachable" in problem.problem["detail"]
        await asyncio.sleep(0.5)
    assert await _counts(rt) == before
    bao.start()
    await _refused(world.controller().fetch_credential(instance_id))  # back, but sealed
    bao.unseal()
    logins = custody.vault.logins
    await _fetch_works(world, instance_id)  # the same service: no restart
    assert custody.vault.logins > logins  # its token expired during the outage: it logged in again

    # The service's token revoked: it logs in again by itself (AppRole) and the caller never notices.
    accessor = custody.vault.call("lookup", lambda c: c.auth.token.lookup_self()["data"]["accessor"])
    box.root.auth.token.revoke_accessor(accessor)
    logins = custody.vault.logins
    await _fetch_works(world, instance_id)
    assert custody.vault.logins == logins + 1
