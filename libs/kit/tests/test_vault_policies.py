"""The committed per-service Vault policies (deploy/vault/policies/*.hcl) on a real OpenBao: each service's
AppRole token reads its own keys and cannot read, unwrap with or write another service's."""

from __future__ import annotations

import pytest

from gpuaas.kit.testing_vault import POLICY_DIR, VaultSandbox
from gpuaas.kit.vault import SecretsUnavailable, TransitKey, VaultClient

pytestmark = pytest.mark.integration

SERVICES = sorted(p.stem for p in POLICY_DIR.glob("*.hcl"))
WITH_KEYRING = {"identity", "allocations", "app-runtime"}


def test_every_service_has_a_policy() -> None:
    assert set(SERVICES) == {"identity", "allocations", "catalog", "app-runtime", "metering", "billing", "gateway"}


def test_each_service_reads_only_its_own_paths(vault: VaultSandbox) -> None:
    root_transit = {s: TransitKey(VaultClient(vault.token_config()), vault.transit, s) for s in WITH_KEYRING}
    wrapped = {}
    for service in SERVICES:
        vault.put(f"{service}/event-signing", seed=f"seed-of-{service}")
        if service in WITH_KEYRING:
            vault.transit_key(service)
            wrapped[service] = root_transit[service].wrap(b"d" * 32, f"{service}:k1".encode())
            vault.put(f"{service}/secrets-keys", keys=f"k1:{wrapped[service]}")
    vault.put("app-runtime/credentials/c1", private_key="pk")

    clients = {s: VaultClient(vault.approle(f"gpuaas-{s}", vault.service_policy(s))) for s in SERVICES}
    for service, client in clients.items():
        assert client.read_kv(vault.kv, f"{service}/event-signing") == {"seed": f"seed-of-{service}"}
        assert client.kv_version(vault.kv, f"{service}/event-signing") == 1
        if service in WITH_KEYRING:
            assert client.read_kv(vault.kv, f"{service}/secrets-keys")["keys"].startswith("k1:vault:v1:")
            own = TransitKey(client, vault.transit, service)
            assert own.unwrap(wrapped[service], f"{service}:k1".encode()) == b"d" * 32
        for other in SERVICES:
            if other == service:
                continue
            with pytest.raises(SecretsUnavailable, match="refused"):
                client.read_kv(vault.kv, f"{other}/event-signing")
            if other in WITH_KEYRING:
                with pytest.raises(SecretsUnavailable, match="refused"):
                    client.read_kv(vault.kv, f"{other}/secrets-keys")
                with pytest.raises(SecretsUnavailable, match="refused"):
                    TransitKey(client, vault.transit, other).unwrap(wrapped[other], f"{other}:k1".encode())
        if service != "app-runtime":
            with pytest.raises(SecretsUnavailable, match="refused"):
                client.read_kv(vault.kv, "app-runtime/credentials/c1")
        # No service may write its own keys (the operator does), nor retire Transit versions.
        with pytest.raises(SecretsUnavailable, match="refused"):
            client.call(
                "write",
                lambda c, s=service: c.secrets.kv.v2.create_or_update_secret(
                    path=f"{s}/event-signing", secret={"seed": "x"}, mount_point=vault.kv
                ),
            )
    runtime = clients["app-runtime"]
    assert runtime.read_kv(vault.kv, "app-runtime/credentials/c1") == {"private_key": "pk"}
    with pytest.raises(SecretsUnavailable, match="refused"):
        runtime.call(
            "retire",
            lambda c: c.secrets.transit.update_key_configuration(
                name="app-runtime", min_decryption_version=1, mount_point=vault.transit
            ),
        )
