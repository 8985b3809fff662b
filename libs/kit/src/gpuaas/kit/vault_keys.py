"""The keys every service needs, from Vault / OpenBao instead of the environment (`secrets_key_source=vault`).

- The secrets-at-rest keyring: KV v2 `<kv mount>/<service>/secrets-keys`, field `keys` =
  `kid:vault:vN:...[,kid:...]` — each data key (32 random bytes) wrapped by the service's Transit key
  (`<transit mount>/keys/<service>`, derived, context `<service>:<kid>`). At start the service unwraps them
  (one Transit call per key) into the same `Keyring` the environment gives, so sealing and opening rows is
  unchanged and needs no network call. The plaintext data keys never leave the service's memory.
- The event-signing key: KV v2 `<kv mount>/<service>/event-signing`, field `seed` (base64 Ed25519 seed), read
  at start; `follow_signing_key` checks the secret's version every `vault_refresh_interval_s` and swaps the
  relay's key in place when it changed (a rotation without a restart).

Operator commands (`python -m gpuaas.kit.vault_keys ...`, with the service's Vault settings in the
environment, a token allowed to write the paths):
- `add-key SERVICE [KID]`: a new data key first in the keyring (rotation of the data key; the service
  re-seals its rows at its next start, `reseal_column`).
- `rewrap SERVICE`: after `transit/keys/<service>/rotate`, every wrapped data key moved to the latest Transit
  key version (a new KV version; nothing to restart).
- `signing-key SERVICE`: a new event-signing key written to KV; prints its public key for
  `GPUAAS_EVENT_VERIFY_KEYS` (add it there first, then write the key).
"""

# hvac ships no type information.
# pyright: reportUnknownMemberType=false, reportUnknownLambdaType=false
from __future__ import annotations

import asyncio
import base64
import os
import sys
from dataclasses import dataclass

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gpuaas.kit.event_signing import EventSigner, generate_seed, public_of
from gpuaas.kit.logging import get_logger
from gpuaas.kit.secrets_at_rest import Keyring, SecretsKeyError
from gpuaas.kit.settings import ServiceSettings
from gpuaas.kit.vault import SecretsUnavailable, TransitKey, VaultClient, VaultConfig

log = get_logger(__name__)
KEYRING_PATH = "secrets-keys"
SIGNING_PATH = "event-signing"


def service_path(settings: ServiceSettings) -> str:
    """The service's folder on the KV mount and its Transit key name: `app-runtime`, `identity`, ..."""
    return settings.service_name.replace("_", "-")


def vault_config(settings: ServiceSettings) -> VaultConfig:
    auth = settings.vault_auth or ("approle" if settings.vault_role_id else "token")
    return VaultConfig(
        url=settings.vault_url,
        auth=auth,
        token=settings.vault_token.get_secret_value(),
        role_id=settings.vault_role_id,
        secret_id=settings.vault_secret_id.get_secret_value(),
        approle_mount=settings.vault_approle_mount,
        ca_cert=settings.vault_ca_cert,
    )


def transit_key(settings: ServiceSettings, vault: VaultClient) -> TransitKey:
    return TransitKey(vault, settings.vault_transit_mount, settings.vault_transit_key or service_path(settings))


def _context(service: str, kid: str) -> bytes:
    return f"{service}:{kid}".encode()


def wrapped_entries(text: str) -> list[tuple[str, str]]:
    entries = [e.strip() for e in text.split(",") if e.strip()]
    out: list[tuple[str, str]] = []
    for entry in entries:
        kid, _, wrapped = entry.partition(":")
        if not kid or not wrapped.startswith("vault:"):
            raise SecretsKeyError(
                "the keyring in Vault holds `kid:vault:vN:...` entries (data keys wrapped by Transit)"
            )
        out.append((kid, wrapped))
    return out


def unwrap_keyring(text: str, transit: TransitKey, service: str) -> Keyring:
    """The wrapped keyring → the keyring (first key seals, every key opens)."""
    pairs = wrapped_entries(text)
    if not pairs:
        raise SecretsKeyError(
            f"the keyring of {service} in Vault is empty: run `python -m gpuaas.kit.vault_keys add-key`"
        )
    keys: dict[str, bytes] = {}
    for kid, wrapped in pairs:
        raw = transit.unwrap(wrapped, _context(service, kid))
        if len(raw) != 32:
            raise SecretsKeyError(f"data key {kid!r} of {service} is not 32 bytes")
        keys[kid] = raw
    return Keyring(keys=keys, primary=pairs[0][0])


def wrap_new_key(text: str, transit: TransitKey, service: str, kid: str) -> str:
    """The wrapped keyring with a fresh data key `kid` first."""
    if any(k == kid for k, _ in wrapped_entries(text)):
        raise SecretsKeyError(f"key id {kid!r} is already in the keyring of {service}")
    wrapped = transit.wrap(AESGCM.generate_key(bit_length=256), _context(service, kid))
    return ",".join([f"{kid}:{wrapped}", *(e.strip() for e in text.split(",") if e.strip())])


def rewrap_keyring(text: str, transit: TransitKey, service: str) -> str:
    """Every wrapped data key moved to the latest Transit key version (the data keys do not change)."""
    return ",".join(f"{kid}:{transit.rewrap(w, _context(service, kid))}" for kid, w in wrapped_entries(text))


def load_keyring(settings: ServiceSettings, vault: VaultClient) -> Keyring:
    service = service_path(settings)
    doc = vault.read_kv(settings.vault_kv_mount, f"{service}/{KEYRING_PATH}")
    return unwrap_keyring(str(doc.get("keys", "")), transit_key(settings, vault), service)


def load_signing_seed(settings: ServiceSettings, vault: VaultClient) -> tuple[str, int]:
    """The signing key's seed and the KV version it came from."""
    path = f"{service_path(settings)}/{SIGNING_PATH}"
    seed = str(vault.read_kv(settings.vault_kv_mount, path).get("seed", ""))
    return seed, vault.kv_version(settings.vault_kv_mount, path)


async def follow_signing_key(
    settings: ServiceSettings, vault: VaultClient, version: int, signer: EventSigner | None, stopping: asyncio.Event
) -> None:
    """Background loop: a new version of the signing key in KV replaces the relay's key in place (no restart)."""
    path = f"{service_path(settings)}/{SIGNING_PATH}"
    while not stopping.is_set():
        try:
            await asyncio.wait_for(stopping.wait(), settings.vault_refresh_interval_s)
            return
        except TimeoutError:
            pass
        try:
            current = await asyncio.to_thread(vault.kv_version, settings.vault_kv_mount, path)
            if current != version and signer is not None:
                seed, version = await asyncio.to_thread(load_signing_seed, settings, vault)
                signer.replace(seed)
                log.info("event_signing_key_rotated", kid=signer.kid, kv_version=version)
        except SecretsUnavailable as exc:  # keep signing with the key we have; try again next round
            log.warning("event_signing_key_not_checked", error=exc.detail)


def _write(vault: VaultClient, mount: str, path: str, doc: dict[str, str]) -> None:
    vault.call(
        f"write {mount}/{path}",
        lambda c: c.secrets.kv.v2.create_or_update_secret(path=path, secret=doc, mount_point=mount),
    )


def main(argv: list[str] | None = None) -> int:
    from gpuaas.kit.settings import service_config

    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] not in {"add-key", "rewrap", "signing-key"}:
        print("usage: python -m gpuaas.kit.vault_keys add-key|rewrap|signing-key SERVICE [KID]", file=sys.stderr)
        return 2
    command, name = args[0], args[1]

    class _Settings(ServiceSettings):
        model_config = service_config(name.replace("-", "_"))

    settings = _Settings(service_name=name.replace("-", "_"))
    vault = VaultClient(vault_config(settings))
    service, mount = service_path(settings), settings.vault_kv_mount
    if command == "signing-key":
        seed = generate_seed()
        _write(vault, mount, f"{service}/{SIGNING_PATH}", {"seed": seed})
        print(f"{service}:{public_of(seed)}")
        return 0
    path = f"{service}/{KEYRING_PATH}"
    try:
        text = str(vault.read_kv(mount, path).get("keys", ""))
    except SecretsUnavailable:
        if command != "add-key":
            raise
        text = ""  # the first key of a new keyring
    transit = transit_key(settings, vault)
    if command == "add-key":
        kid = args[2] if len(args) > 2 else "k" + base64.b32encode(os.urandom(5)).decode().lower()
        text = wrap_new_key(text, transit, service, kid)
    else:
        text = rewrap_keyring(text, transit, service)
    _write(vault, mount, path, {"keys": text})
    print(f"{service}: keyring {', '.join(k for k, _ in wrapped_entries(text))} (Transit v{transit.latest_version()})")
    return 0


@dataclass
class ServiceKeys:
    keyring: Keyring | None
    signing_seed: str | None  # None: the environment's (`event_signing_key`)
    vault: VaultClient | None = None
    signing_version: int = 0


async def service_keys(settings: ServiceSettings, secrets_at_rest: bool) -> ServiceKeys:
    """The keys a service starts with, from the source its settings name. With `vault`, an unreachable or
    sealed server stops the start-up with SecretsUnavailable (the orchestrator restarts it)."""
    if settings.secrets_key_source == "env":
        keyring = Keyring.parse(settings.secrets_keys.get_secret_value()) if secrets_at_rest else None
        return ServiceKeys(keyring=keyring, signing_seed=None)
    vault = VaultClient(vault_config(settings))
    keyring = await asyncio.to_thread(load_keyring, settings, vault) if secrets_at_rest else None
    try:
        seed, version = await asyncio.to_thread(load_signing_seed, settings, vault)
    except SecretsUnavailable as exc:
        if "not found" not in exc.detail:
            raise
        seed, version = "", 0  # no signing key in Vault: the service must not need one (event_keys checks)
    log.info("keys_from_vault", keyring=keyring.primary if keyring else None, signing_kv_version=version)
    return ServiceKeys(keyring=keyring, signing_seed=seed, vault=vault, signing_version=version)


if __name__ == "__main__":
    raise SystemExit(main())
