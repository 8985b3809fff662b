"""Secrets at rest: values a service must keep readable (token-signing keys, the SSH CA key, IdP client
secrets, credential data keys) are stored sealed under a key the operator provides.

- Keyring: `GPUAAS_SECRETS_KEYS` = `kid:base64(32 bytes)[,kid:base64...]`; the first key seals, every key
  opens (rotation: put the new key first, keep the old one until `reseal_column` has run at start-up).
- Seal: AES-256-GCM, 96-bit random nonce, the row's identity (`context`, e.g.
  `identity.signing_keys.private_jwk:<kid>`) as associated data, so a sealed value copied to another row
  does not open. Stored as `gpuaas:enc:v1:<kid>:<base64(nonce || ciphertext)>`.
- There is no default key: a service that stores secrets refuses to start without one, and refuses the
  development key older versions shipped. The local stack generates a key into `.local/secrets.json`.
- Clear rows from older versions are sealed in place at start-up (`reseal_column`), in one transaction,
  together with rows sealed under a key that is no longer first (rotation). A row sealed under a key id
  the keyring does not hold stops the start-up with a message naming the key id.

Vault is not needed for this: the operator's key is a Kubernetes Secret (or any secret store that can
set an environment variable); app-runtime's credential custody can still use Vault for its own records.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import Table, select, update
from sqlalchemy.ext.asyncio import AsyncSession

PREFIX = "gpuaas:enc:v1:"
SESSION_KEY = "secrets_keyring"  # where a service's sessions carry the keyring (`session.info`)
ENV_VAR = "GPUAAS_SECRETS_KEYS"
# Keys that were published in this repository (app-runtime's former development KEK): never accepted.
KNOWN_PUBLIC_KEYS = frozenset({"ZGV2LW9ubHkta2VrLWRvLW5vdC11c2UtaW4tcHJvZCE="})


class SecretsKeyError(ValueError):
    """No usable key: missing, malformed, publicly known, or not the key a sealed value was sealed with."""


def generate_key_text(kid: str | None = None) -> str:
    """A fresh keyring entry `kid:base64key` (what the local stack and the tests use)."""
    return f"{kid or 'k' + secrets.token_hex(4)}:{base64.b64encode(AESGCM.generate_key(bit_length=256)).decode()}"


@dataclass(frozen=True)
class Keyring:
    keys: Mapping[str, bytes]
    primary: str

    @classmethod
    def parse(cls, text: str, *, source: str = ENV_VAR) -> Keyring:
        entries = [e.strip() for e in text.split(",") if e.strip()]
        if not entries:
            raise SecretsKeyError(
                f"{source} is not set: this service stores secrets (signing keys, client secrets) encrypted at "
                "rest and has no default key. Set it to `kid:<base64 of 32 random bytes>` "
                "(e.g. `python -c 'import base64,os;print(\"k1:\"+base64.b64encode(os.urandom(32)).decode())'`)."
            )
        keys: dict[str, bytes] = {}
        for entry in entries:
            kid, sep, b64 = entry.partition(":")
            if not sep or not kid or ":" in b64:
                raise SecretsKeyError(f"{source}: each entry is `kid:base64key` (got an entry without a key id)")
            if b64 in KNOWN_PUBLIC_KEYS:
                raise SecretsKeyError(f"{source}: key {kid!r} is a published development key; generate your own")
            try:
                raw = base64.b64decode(b64, validate=True)
            except binascii.Error:
                raise SecretsKeyError(f"{source}: key {kid!r} is not base64") from None
            if len(raw) != 32:
                raise SecretsKeyError(f"{source}: key {kid!r} must be 32 bytes (AES-256), got {len(raw)}")
            if kid in keys:
                raise SecretsKeyError(f"{source}: key id {kid!r} appears twice")
            keys[kid] = raw
        return cls(keys=keys, primary=entries[0].partition(":")[0])

    def seal(self, plaintext: str, context: str) -> str:
        nonce = os.urandom(12)
        sealed = AESGCM(self.keys[self.primary]).encrypt(nonce, plaintext.encode(), context.encode())
        return f"{PREFIX}{self.primary}:{base64.b64encode(nonce + sealed).decode()}"

    def open(self, value: str, context: str) -> str:
        if not is_sealed(value):
            raise SecretsKeyError(f"{context}: value is not sealed")
        kid, _, b64 = value.removeprefix(PREFIX).partition(":")
        key = self.keys.get(kid)
        if key is None:
            raise SecretsKeyError(f"{context}: sealed under key id {kid!r}, which {ENV_VAR} does not hold")
        blob = base64.b64decode(b64)
        try:
            return AESGCM(key).decrypt(blob[:12], blob[12:], context.encode()).decode()
        except InvalidTag:
            raise SecretsKeyError(
                f"{context}: key {kid!r} does not open this value (wrong key or altered row)"
            ) from None

    def seal_json(self, value: Any, context: str) -> dict[str, str]:
        """A JSON document sealed into a JSON column: `{"sealed": "gpuaas:enc:v1:..."}`."""
        return {"sealed": self.seal(json.dumps(value, separators=(",", ":")), context)}

    def open_json(self, stored: Any, context: str) -> Any:
        if not is_sealed_json(stored):
            raise SecretsKeyError(f"{context}: value is not sealed")
        return json.loads(self.open(stored["sealed"], context))

    def needs_reseal(self, value: str) -> bool:
        return not is_sealed(value) or value.removeprefix(PREFIX).partition(":")[0] != self.primary


def is_sealed(value: object) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def is_sealed_json(value: object) -> bool:
    if not isinstance(value, dict):
        return False
    fields = cast(dict[str, object], value)
    return set(fields) == {"sealed"} and is_sealed(fields["sealed"])


def keyring_of(session: AsyncSession) -> Keyring:
    """The keyring a service's sessions carry (set by the kit for a spec with `secrets_at_rest=True`)."""
    keyring = session.info.get(SESSION_KEY)
    if not isinstance(keyring, Keyring):
        raise SecretsKeyError("this service was started without a secrets keyring (ServiceSpec.secrets_at_rest)")
    return keyring


async def reseal_column(
    session: AsyncSession, table: Table, key_column: str, value_column: str, context: str, *, as_json: bool = False
) -> int:
    """Seal every clear value of `table.value_column` and re-seal values sealed under an older key, in the
    caller's transaction; returns how many rows changed. For the small tables that hold a service's own
    secrets (a handful of rows): all rows are read. Raises SecretsKeyError for a value no key opens."""
    keyring = keyring_of(session)
    key_col, value_col = table.c[key_column], table.c[value_column]
    rows = (await session.execute(select(key_col, value_col).where(value_col.is_not(None)).with_for_update())).all()
    changed = 0
    for row_key, value in rows:
        ctx = f"{context}:{row_key}"
        # Every sealed value is opened, so a wrong key stops the start-up here rather than at first use.
        if as_json:
            sealed = value["sealed"] if is_sealed_json(value) else None
            clear: Any = keyring.open_json(value, ctx) if sealed else value
            if sealed and not keyring.needs_reseal(sealed):
                continue
            new: Any = keyring.seal_json(clear, ctx)
        else:
            clear = keyring.open(value, ctx) if is_sealed(value) else value
            if is_sealed(value) and not keyring.needs_reseal(value):
                continue
            new = keyring.seal(clear, ctx)
        await session.execute(update(table).where(key_col == row_key).values({value_column: new}))
        changed += 1
    return changed
