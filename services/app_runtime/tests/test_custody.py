"""Envelope encryption of access credentials (the custody used where Vault is not configured)."""

from __future__ import annotations

import base64
import os
import uuid
from types import SimpleNamespace

import asyncssh
import pytest
from cryptography.exceptions import InvalidTag

from gpuaas.app_runtime.custody import SchemaCustody, generate_key_pair


def _row(sealed) -> SimpleNamespace:
    return SimpleNamespace(**sealed.columns())


async def test_seal_open_round_trip_and_nothing_in_clear() -> None:
    custody = SchemaCustody.from_kek(base64.b64encode(os.urandom(32)).decode(), "kek-test")
    pair = generate_key_pair("test")
    assert "PRIVATE" not in repr(pair)
    cid = uuid.uuid4()
    sealed = await custody.seal(cid, pair.private_openssh)
    assert sealed.custody == "schema" and sealed.kek_id == "kek-test"
    assert b"OPENSSH" not in sealed.ciphertext and pair.private_openssh.encode() not in sealed.ciphertext
    opened = await custody.open(cid, _row(sealed))
    assert asyncssh.import_private_key(opened).export_public_key().decode().strip() == pair.public_openssh


async def test_ciphertext_is_bound_to_its_credential_and_key() -> None:
    kek = base64.b64encode(os.urandom(32)).decode()
    custody = SchemaCustody.from_kek(kek, "kek-test")
    cid = uuid.uuid4()
    sealed = await custody.seal(cid, generate_key_pair("x").private_openssh)
    with pytest.raises(InvalidTag):  # moved to another credential row
        await custody.open(uuid.uuid4(), _row(sealed))
    other = SchemaCustody.from_kek(base64.b64encode(os.urandom(32)).decode(), "kek-test")
    with pytest.raises(InvalidTag):  # a different key-encryption key
        await other.open(cid, _row(sealed))
    tampered = _row(sealed)
    tampered.ciphertext = bytes([sealed.ciphertext[0] ^ 1]) + sealed.ciphertext[1:]
    with pytest.raises(InvalidTag):
        await custody.open(cid, tampered)
    with pytest.raises(ValueError):
        SchemaCustody.from_kek(base64.b64encode(b"short").decode(), "k")


def test_no_default_key_and_the_published_development_key_is_refused() -> None:
    from gpuaas.app_runtime.custody import make_custody
    from gpuaas.app_runtime.settings import Settings
    from gpuaas.kit.secrets_at_rest import SecretsKeyError

    with pytest.raises(SecretsKeyError, match="GPUAAS_SECRETS_KEYS"):
        make_custody(Settings(), None)  # neither an explicit KEK nor the service's keyring
    with pytest.raises(SecretsKeyError, match="published development key"):  # the former DEV_KEK
        make_custody(Settings(credential_kek="ZGV2LW9ubHkta2VrLWRvLW5vdC11c2UtaW4tcHJvZCE="), None)


async def test_a_rotated_keyring_opens_what_the_old_key_sealed_and_seals_with_the_new() -> None:
    from gpuaas.kit.secrets_at_rest import Keyring, generate_key_text

    old_text, new_text = generate_key_text("old"), generate_key_text("new")
    old = SchemaCustody(Keyring.parse(old_text))
    cid = uuid.uuid4()
    pair = generate_key_pair("rot")
    sealed = await old.seal(cid, pair.private_openssh)
    rotated = SchemaCustody(Keyring.parse(f"{new_text},{old_text}"))
    assert await rotated.open(cid, _row(sealed)) == pair.private_openssh
    assert (await rotated.seal(cid, pair.private_openssh)).kek_id == "new"
    from gpuaas.kit.errors import Unavailable

    with pytest.raises(Unavailable):  # the old key removed too early: refused, not garbage
        await SchemaCustody(Keyring.parse(new_text)).open(cid, _row(sealed))
