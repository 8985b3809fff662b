"""Custody of access credentials (SSH key pairs of app instances).

Two backends behind one interface:
- `SchemaCustody`: envelope encryption in this service's schema. Each private key is encrypted with
  its own random 256-bit data key (AES-GCM, the credential id as associated data); the data key is
  wrapped with the key-encryption key (AES-GCM, same associated data). Only ciphertext, nonces, the
  wrapped data key and the KEK id are stored. The KEKs are the operator's keyring (GPUAAS_SECRETS_KEYS,
  or an explicit GPUAAS_APP_RUNTIME_CREDENTIAL_KEK): the first seals, every key of the ring opens what it
  sealed (rotation). There is no default key: without one the service does not start.
- `TransitCustody`: the same envelope with each data key wrapped by Vault/OpenBao Transit
  (`credential_backend = "transit"`); `gpuaas.app_runtime.rewrap` moves rows to the latest Transit version.
- `VaultCustody`: Vault/OpenBao KV v2 through hvac (used where `credential_backend = "vault"`).
  Vault calls happen before or after the database transaction (never a network call inside it).

Private keys never appear in events, ordinary responses or logs: `Sealed` holds what is stored,
and only `open()` (the controller's credential fetch) turns it back into the key.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import asyncssh
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gpuaas.app_runtime.settings import Settings
from gpuaas.kit.errors import Unavailable
from gpuaas.kit.logging import get_logger
from gpuaas.kit.secrets_at_rest import Keyring, SecretsKeyError
from gpuaas.kit.vault import TransitKey, VaultClient, ciphertext_version
from gpuaas.kit.vault_keys import transit_key, vault_config

log = get_logger(__name__)


@dataclass(frozen=True)
class KeyPair:
    private_openssh: str
    public_openssh: str
    fingerprint: str

    def __repr__(self) -> str:  # never print the private half
        return f"KeyPair(fingerprint={self.fingerprint!r})"


def generate_key_pair(comment: str) -> KeyPair:
    key = asyncssh.generate_private_key("ssh-ed25519", comment=comment)
    return KeyPair(
        private_openssh=key.export_private_key("openssh").decode(),
        public_openssh=key.export_public_key("openssh").decode().strip(),
        fingerprint=key.get_fingerprint("sha256"),
    )


@dataclass(frozen=True)
class Sealed:
    """What goes into the `credentials` row (no plaintext)."""

    custody: str
    ciphertext: bytes | None = None
    nonce: bytes | None = None
    wrapped_dek: bytes | None = None
    dek_nonce: bytes | None = None
    kek_id: str | None = None
    vault_path: str | None = None

    def columns(self) -> dict[str, Any]:
        return {
            "custody": self.custody,
            "ciphertext": self.ciphertext,
            "nonce": self.nonce,
            "wrapped_dek": self.wrapped_dek,
            "dek_nonce": self.dek_nonce,
            "kek_id": self.kek_id,
            "vault_path": self.vault_path,
        }


class Custody(Protocol):
    async def seal(self, credential_id: uuid.UUID, private_key: str) -> Sealed: ...

    async def open(self, credential_id: uuid.UUID, sealed: Sealed) -> str: ...


class SchemaCustody:
    def __init__(self, keyring: Keyring) -> None:
        self._keks = {kid: AESGCM(key) for kid, key in keyring.keys.items()}
        self.kek_id = keyring.primary
        self._kek = self._keks[self.kek_id]

    @classmethod
    def from_kek(cls, kek_b64: str, kek_id: str) -> SchemaCustody:
        """One explicit KEK (GPUAAS_APP_RUNTIME_CREDENTIAL_KEK); a published key is refused."""
        return cls(Keyring.parse(f"{kek_id}:{kek_b64}", source="GPUAAS_APP_RUNTIME_CREDENTIAL_KEK"))

    async def seal(self, credential_id: uuid.UUID, private_key: str) -> Sealed:
        aad = credential_id.bytes
        dek = AESGCM.generate_key(bit_length=256)
        nonce, dek_nonce = os.urandom(12), os.urandom(12)
        return Sealed(
            custody="schema",
            ciphertext=AESGCM(dek).encrypt(nonce, private_key.encode(), aad),
            nonce=nonce,
            wrapped_dek=self._kek.encrypt(dek_nonce, dek, aad),
            dek_nonce=dek_nonce,
            kek_id=self.kek_id,
        )

    def unwrap_dek(self, credential_id: uuid.UUID, sealed: Sealed) -> bytes:
        kek = self._keks.get(sealed.kek_id or "")
        if kek is None:
            raise Unavailable(f"credential sealed with unknown key {sealed.kek_id}", code="credential_key_unavailable")
        # sealed by this custody (its key id): every part of the envelope is there
        assert sealed.dek_nonce and sealed.wrapped_dek
        return kek.decrypt(sealed.dek_nonce, sealed.wrapped_dek, credential_id.bytes)

    async def open(self, credential_id: uuid.UUID, sealed: Sealed) -> str:
        dek = self.unwrap_dek(credential_id, sealed)
        assert sealed.nonce and sealed.ciphertext is not None
        return AESGCM(dek).decrypt(sealed.nonce, sealed.ciphertext, credential_id.bytes).decode()


class TransitCustody:
    """Envelope encryption in this schema with the data key wrapped by Vault's Transit (`credential_backend =
    "transit"`): the row keeps `wrapped_dek` = the Transit ciphertext (`vault:vN:...`, bound to the credential id
    as the derived key's context) and `kek_id` = `transit:<key>:v<N>`. Rows sealed before under the keyring
    (`fallback`) still open; `gpuaas.app_runtime.rewrap` moves them, and rows of an older Transit version, to the
    latest version. Every seal and open is one Transit call, made outside any transaction."""

    def __init__(self, transit: TransitKey, fallback: SchemaCustody | None = None) -> None:
        self.transit = transit
        self.fallback = fallback

    def kek_id(self, wrapped: str) -> str:
        return f"transit:{self.transit.name}:v{ciphertext_version(wrapped)}"

    async def seal(self, credential_id: uuid.UUID, private_key: str) -> Sealed:
        dek = AESGCM.generate_key(bit_length=256)
        nonce = os.urandom(12)
        wrapped = await self.transit.awrap(dek, credential_id.bytes)
        return Sealed(
            custody="schema",
            ciphertext=AESGCM(dek).encrypt(nonce, private_key.encode(), credential_id.bytes),
            nonce=nonce,
            wrapped_dek=wrapped.encode(),
            kek_id=self.kek_id(wrapped),
        )

    async def open(self, credential_id: uuid.UUID, sealed: Sealed) -> str:
        if not (sealed.kek_id or "").startswith("transit:"):
            if self.fallback is None:
                raise Unavailable(
                    f"credential sealed with key {sealed.kek_id} and no keyring configured",
                    code="credential_key_unavailable",
                )
            return await self.fallback.open(credential_id, sealed)
        assert sealed.wrapped_dek and sealed.nonce and sealed.ciphertext is not None
        dek = await self.transit.aunwrap(sealed.wrapped_dek.decode(), credential_id.bytes)
        return AESGCM(dek).decrypt(sealed.nonce, sealed.ciphertext, credential_id.bytes).decode()


class VaultCustody:
    """KV v2 in Vault / OpenBao (`credential_backend = "vault"`). hvac is synchronous: calls run in a thread,
    outside any transaction. A sealed, unreachable or refusing server raises SecretsUnavailable (503
    `secrets_unavailable`) before anything is recorded; the client logs in again by itself once it is back."""

    def __init__(self, vault: VaultClient, mount: str, prefix: str) -> None:
        self.vault = vault
        self.mount = mount
        self.prefix = prefix.strip("/")

    async def seal(self, credential_id: uuid.UUID, private_key: str) -> Sealed:
        path = f"{self.prefix}/{credential_id}"
        await self.vault.acall(
            "store the credential",
            lambda c: c.secrets.kv.v2.create_or_update_secret(
                path=path, secret={"private_key": private_key}, mount_point=self.mount
            ),
        )
        return Sealed(custody="vault", vault_path=path)

    async def open(self, credential_id: uuid.UUID, sealed: Sealed) -> str:
        path = sealed.vault_path or f"{self.prefix}/{credential_id}"
        answer = await self.vault.acall(
            "read the credential",
            lambda c: c.secrets.kv.v2.read_secret_version(
                path=path, mount_point=self.mount, raise_on_deleted_version=True
            ),
        )
        return str(answer["data"]["data"]["private_key"])


def make_custody(settings: Settings, keyring: Keyring | None = None) -> Custody:
    """The configured backend. `schema` seals under GPUAAS_APP_RUNTIME_CREDENTIAL_KEK when set, else under the
    service's keyring (GPUAAS_SECRETS_KEYS); with neither it refuses to start (no default key, issue 17).
    `vault` and `transit` use the kit's Vault client (AppRole or a token: `GPUAAS_APP_RUNTIME_VAULT_*`)."""
    if settings.credential_backend in ("vault", "transit"):
        vault = VaultClient(vault_config(settings))
        if settings.credential_backend == "vault":
            return VaultCustody(vault, settings.vault_mount, settings.vault_path_prefix)
        fallback = _schema_custody(settings, keyring) if keyring or settings.credential_kek.get_secret_value() else None
        return TransitCustody(transit_key(settings, vault), fallback)
    return _schema_custody(settings, keyring)


def _schema_custody(settings: Settings, keyring: Keyring | None) -> SchemaCustody:
    kek = settings.credential_kek.get_secret_value()
    if kek:
        return SchemaCustody.from_kek(kek, settings.credential_kek_id)
    if keyring is None:
        raise SecretsKeyError(
            "credential custody `schema` needs GPUAAS_SECRETS_KEYS or GPUAAS_APP_RUNTIME_CREDENTIAL_KEK"
        )
    return SchemaCustody(keyring)
