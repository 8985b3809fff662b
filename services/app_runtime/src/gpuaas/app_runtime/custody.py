"""Custody of access credentials (SSH key pairs of app instances).

Two backends behind one interface:
- `SchemaCustody`: envelope encryption in this service's schema. Each private key is encrypted with
  its own random 256-bit data key (AES-GCM, the credential id as associated data); the data key is
  wrapped with the key-encryption key (AES-GCM, same associated data). Only ciphertext, nonces, the
  wrapped data key and the KEK id are stored. The KEKs are the operator's keyring (GPUAAS_SECRETS_KEYS,
  or an explicit GPUAAS_APP_RUNTIME_CREDENTIAL_KEK): the first seals, every key of the ring opens what it
  sealed (rotation). There is no default key: without one the service does not start.
- `VaultCustody`: HashiCorp Vault KV v2 through hvac (used where `credential_backend = "vault"`).
  The write happens before the database transaction (never a network call inside it).

Private keys never appear in events, ordinary responses or logs: `Sealed` holds what is stored,
and only `open()` (the controller's credential fetch) turns it back into the key.
"""

from __future__ import annotations

import asyncio
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

    async def open(self, credential_id: uuid.UUID, sealed: Sealed) -> str:
        kek = self._keks.get(sealed.kek_id or "")
        if kek is None:
            raise Unavailable(f"credential sealed with unknown key {sealed.kek_id}", code="credential_key_unavailable")
        # sealed by this custody (its key id): every part of the envelope is there
        assert sealed.dek_nonce and sealed.wrapped_dek and sealed.nonce and sealed.ciphertext is not None
        aad = credential_id.bytes
        dek = kek.decrypt(sealed.dek_nonce, sealed.wrapped_dek, aad)
        return AESGCM(dek).decrypt(sealed.nonce, sealed.ciphertext, aad).decode()


class VaultCustody:
    """KV v2 in Vault. hvac is synchronous: calls run in a thread, outside any transaction."""

    def __init__(self, url: str, token: str, mount: str, prefix: str) -> None:
        import hvac

        self._client = hvac.Client(url=url, token=token)
        self.mount = mount
        self.prefix = prefix.strip("/")

    async def seal(self, credential_id: uuid.UUID, private_key: str) -> Sealed:
        path = f"{self.prefix}/{credential_id}"
        try:
            await asyncio.to_thread(
                self._client.secrets.kv.v2.create_or_update_secret,
                path=path,
                secret={"private_key": private_key},
                mount_point=self.mount,
            )
        except Exception as exc:  # hvac raises many types; none may leak the secret
            raise Unavailable(f"vault write failed: {exc.__class__.__name__}", code="vault_unavailable") from None
        return Sealed(custody="vault", vault_path=path)

    async def open(self, credential_id: uuid.UUID, sealed: Sealed) -> str:
        try:
            answer = await asyncio.to_thread(
                self._client.secrets.kv.v2.read_secret_version,
                path=sealed.vault_path,
                mount_point=self.mount,
                raise_on_deleted_version=True,
            )
        except Exception as exc:
            raise Unavailable(f"vault read failed: {exc.__class__.__name__}", code="vault_unavailable") from None
        return str(answer["data"]["data"]["private_key"])


def make_custody(settings: Settings, keyring: Keyring | None = None) -> Custody:
    """The configured backend. `schema` seals under GPUAAS_APP_RUNTIME_CREDENTIAL_KEK when set, else under the
    service's keyring (GPUAAS_SECRETS_KEYS); with neither it refuses to start (no default key, issue 17)."""
    if settings.credential_backend == "vault":
        if settings.vault_token is None:
            raise ValueError("credential_backend=vault needs vault_token")
        return VaultCustody(
            settings.vault_url,
            settings.vault_token.get_secret_value(),
            settings.vault_mount,
            settings.vault_path_prefix,
        )
    kek = settings.credential_kek.get_secret_value()
    if kek:
        return SchemaCustody.from_kek(kek, settings.credential_kek_id)
    if keyring is None:
        raise SecretsKeyError(
            "credential custody `schema` needs GPUAAS_SECRETS_KEYS or GPUAAS_APP_RUNTIME_CREDENTIAL_KEK"
        )
    return SchemaCustody(keyring)
