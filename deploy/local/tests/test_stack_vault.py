"""`GPUAAS_VAULT=openbao make run`: the stack's local OpenBao (gpuaas.devstack.vault) set up as an operator would,
each service able to load exactly its own keys with its own AppRole; kept across a restart (sealed, then
unsealed with the saved key); and a stack with identity started on those keys."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpuaas.devstack.config import SERVICES, StackConfig
from gpuaas.devstack.credentials import Credentials
from gpuaas.devstack.stack import Stack
from gpuaas.devstack.testing import remove_root, temp_root
from gpuaas.devstack.vault import LocalVault
from gpuaas.kit.secrets_at_rest import Keyring
from gpuaas.kit.settings import ServiceSettings, service_config
from gpuaas.kit.vault import SecretsUnavailable, VaultClient
from gpuaas.kit.vault_keys import load_keyring, load_signing_seed, vault_config

pytestmark = pytest.mark.integration


@pytest.fixture
def root() -> Iterator[Path]:
    path = temp_root("gpuaas-devstack-vault-")
    yield path
    remove_root(path)


def settings_of(name: str, env: dict[str, str]) -> ServiceSettings:
    class _Settings(ServiceSettings):
        model_config = service_config(name)

    prefix = f"GPUAAS_{name.upper()}_"
    values = {k.removeprefix(prefix).lower(): v for k, v in env.items() if k.startswith(prefix)}
    return _Settings(service_name=name, secrets_key_source=env["GPUAAS_SECRETS_KEY_SOURCE"], **values)


def test_each_service_loads_its_own_keys_and_they_survive_a_restart(root: Path) -> None:
    creds = Credentials(root / "secrets.json", "admin@example.test")
    vault = LocalVault(root, creds, list(SERVICES))
    vault.start()
    try:
        for name in SERVICES:
            settings = settings_of(name, vault.env(name))
            client = VaultClient(vault_config(settings))
            seed, _ = load_signing_seed(settings, client)
            assert seed == creds.event_signing_key(name)
            if name in ("identity", "allocations", "app_runtime"):
                ring = load_keyring(settings, client)
                assert ring.keys == Keyring.parse(creds.secrets_keys).keys  # the stack's keyring, via Transit
        other = settings_of("billing", vault.env("billing"))
        with pytest.raises(SecretsUnavailable, match="refused"):  # billing's token cannot read identity's keys
            VaultClient(vault_config(other)).read_kv("gpuaas-kv", "identity/secrets-keys")

        vault.stop()
        again = LocalVault(root, creds, list(SERVICES))
        again.start()  # the same data: unsealed with the saved key, set up again idempotently
        try:
            settings = settings_of("identity", again.env("identity"))
            ring = load_keyring(settings, VaultClient(vault_config(settings)))
            assert ring.keys == Keyring.parse(creds.secrets_keys).keys
        finally:
            again.stop()
    finally:
        vault.stop()


def test_a_stack_runs_identity_on_keys_from_openbao(root: Path) -> None:
    stack = Stack(
        StackConfig(
            root=root, services=["identity"], gateway=False, free_ports=True, agents=(), runtime_images=False,
            vault="openbao", ready_timeout_s=120,
        )
    )  # fmt: skip
    with stack:
        env = stack.env_for("identity")
        assert env["GPUAAS_SECRETS_KEY_SOURCE"] == "vault" and "GPUAAS_SECRETS_KEYS" not in env
        assert "GPUAAS_IDENTITY_EVENT_SIGNING_KEY" not in env
        jwks = httpx.get(f"{stack.service_url('identity')}/.well-known/jwks.json", timeout=10)
        assert jwks.status_code == 200 and jwks.json()["keys"]  # its signing keys opened with the Vault keyring
