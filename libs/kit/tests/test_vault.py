"""The kit's Vault client against a real OpenBao (the `vault` sandbox: this test's own mounts): AppRole login,
renewal before expiry, a new login after revocation, and a refused/sealed/unreachable server as the one
503 problem (`secrets_unavailable`)."""

from __future__ import annotations

import time

import pytest

from gpuaas.kit.errors import problem_body
from gpuaas.kit.testing_vault import VaultSandbox
from gpuaas.kit.vault import SecretsUnavailable, TransitKey, VaultClient, VaultConfig, ciphertext_version

pytestmark = pytest.mark.integration

READ_ALL = 'path "gpuaas-kv/data/*" { capabilities = ["read"] }\n'


def _lookup_accessor(client: VaultClient) -> str:
    return client.call("lookup", lambda c: c.auth.token.lookup_self()["data"]["accessor"])


def test_approle_token_is_renewed_before_it_expires(vault: VaultSandbox) -> None:
    vault.put("app/x", value="1")
    # A 2 s token renewed when half its TTL is left; used for three TTLs without a new login.
    client = VaultClient(vault.approle("renewing", READ_ALL, token_ttl="2s", token_max_ttl="1h"))
    first = _lookup_accessor(client)
    end = time.monotonic() + 6.0
    while time.monotonic() < end:
        assert client.read_kv(vault.kv, "app/x") == {"value": "1"}
        time.sleep(0.3)
    assert client.logins == 1 and client.renewals >= 3
    assert _lookup_accessor(client) == first  # the same token, kept alive past its first expiry


def test_a_token_at_its_max_ttl_is_replaced_by_a_new_login(vault: VaultSandbox) -> None:
    vault.put("app/x", value="1")
    client = VaultClient(vault.approle("capped", READ_ALL, token_ttl="2s", token_max_ttl="3s"))
    end = time.monotonic() + 7.0
    while time.monotonic() < end:
        assert client.read_kv(vault.kv, "app/x") == {"value": "1"}
        time.sleep(0.3)
    assert client.logins >= 2


def test_a_revoked_token_is_replaced_and_a_static_one_fails_cleanly(vault: VaultSandbox) -> None:
    secret = "s3cret-never-in-an-error"
    vault.put("app/x", value=secret)
    client = VaultClient(vault.approle("revoked", READ_ALL))
    assert client.read_kv(vault.kv, "app/x") == {"value": secret}
    vault.root.auth.token.revoke_accessor(_lookup_accessor(client))
    assert client.read_kv(vault.kv, "app/x") == {"value": secret}  # logged in again by itself
    assert client.logins == 2

    token = vault.root.auth.token.create(policies=["default"], ttl="1h")["auth"]["client_token"]
    static = VaultClient(VaultConfig(url=vault.url, auth="token", token=token))
    with pytest.raises(SecretsUnavailable, match="refused this service's credentials") as refused:
        static.read_kv(vault.kv, "app/x")  # the default policy does not read KV
    body = problem_body(refused.value.status, refused.value.code, refused.value.title, refused.value.detail)
    assert body["status"] == 503 and body["code"] == "secrets_unavailable" and secret not in body["detail"]


def test_a_policy_denies_other_paths(vault: VaultSandbox) -> None:
    vault.put("mine/x", value="m")
    vault.put("theirs/x", value="t")
    client = VaultClient(vault.approle("narrow", 'path "gpuaas-kv/data/mine/*" { capabilities = ["read"] }\n'))
    assert client.read_kv(vault.kv, "mine/x") == {"value": "m"}
    with pytest.raises(SecretsUnavailable, match="refused"):
        client.read_kv(vault.kv, "theirs/x")
    assert client.logins == 2  # a 403 is tried once more with a fresh login, then reported


def test_transit_wraps_bound_to_context_and_rewraps_to_the_latest_version(vault: VaultSandbox) -> None:
    vault.transit_key("svc")
    key = TransitKey(VaultClient(vault.token_config()), vault.transit, "svc")
    wrapped = key.wrap(b"k" * 32, b"row-1")
    assert ciphertext_version(wrapped) == 1 and key.unwrap(wrapped, b"row-1") == b"k" * 32
    with pytest.raises(SecretsUnavailable):  # another row's context: the derived key differs
        key.unwrap(wrapped, b"row-2")
    assert vault.rotate("svc") == 2
    moved = key.rewrap(wrapped, b"row-1")
    assert ciphertext_version(moved) == 2 and key.unwrap(moved, b"row-1") == b"k" * 32


def test_sealed_and_stopped_server_fail_cleanly_and_recover(openbao_raft, tmp_path) -> None:
    """A raft server: sealed → 503; stopped past the token's TTL → 503; restarted and unsealed → works, with a
    fresh login (the token expired meanwhile), without a new client."""
    box = VaultSandbox.create(openbao_raft.url, openbao_raft.root_token)
    box.put("app/x", value="1")
    client = VaultClient(box.approle("outage", READ_ALL, token_ttl="2s", token_max_ttl="1h"))
    assert client.read_kv(box.kv, "app/x") == {"value": "1"}

    openbao_raft.seal()
    with pytest.raises(SecretsUnavailable, match="sealed"):
        client.read_kv(box.kv, "app/x")
    openbao_raft.unseal()
    assert client.read_kv(box.kv, "app/x") == {"value": "1"}

    openbao_raft.stop()
    with pytest.raises(SecretsUnavailable, match="unreachable"):
        client.read_kv(box.kv, "app/x")
    expired = time.monotonic() + 2.5  # the token's TTL passes while the server is down
    while time.monotonic() < expired:
        time.sleep(0.2)
    with pytest.raises(SecretsUnavailable, match="unreachable"):
        client.read_kv(box.kv, "app/x")
    openbao_raft.start()
    with pytest.raises(SecretsUnavailable, match="sealed"):  # a restarted server comes back sealed
        client.read_kv(box.kv, "app/x")
    openbao_raft.unseal()
    assert client.read_kv(box.kv, "app/x") == {"value": "1"}  # the data survived; the client recovered
    assert client.logins == 2


async def test_a_service_does_not_start_on_a_sealed_server_and_does_once_unsealed(openbao_raft) -> None:
    """`secrets_key_source=vault` at start: sealed → the start-up stops with `secrets_unavailable` (the orchestrator
    restarts it); unsealed → the keyring and the signing key load."""
    from gpuaas.kit.event_signing import generate_seed
    from gpuaas.kit.settings import ServiceSettings
    from gpuaas.kit.vault_keys import service_keys, wrap_new_key

    box = VaultSandbox.create(openbao_raft.url, openbao_raft.root_token)
    box.transit_key("svc")
    transit = TransitKey(VaultClient(box.token_config()), box.transit, "svc")
    box.put("svc/secrets-keys", keys=wrap_new_key("", transit, "svc", "k1"))
    box.put("svc/event-signing", seed=generate_seed())
    role = box.approle("svc", box.service_policy("identity").replace("identity", "svc"))
    settings = ServiceSettings(
        service_name="svc",
        secrets_key_source="vault",
        vault_url=role.url,
        vault_role_id=role.role_id,
        vault_secret_id=role.secret_id,
        vault_approle_mount=role.approle_mount,
        vault_kv_mount=box.kv,
        vault_transit_mount=box.transit,
    )
    openbao_raft.seal()
    with pytest.raises(SecretsUnavailable, match="sealed"):
        await service_keys(settings, secrets_at_rest=True)
    openbao_raft.unseal()
    keys = await service_keys(settings, secrets_at_rest=True)
    assert keys.keyring is not None and keys.keyring.primary == "k1" and keys.signing_seed and keys.signing_version == 1
