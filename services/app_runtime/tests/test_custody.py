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


def _row(sealed) -> SimpleNamespace:  # type: ignore[no-untyped-def]
    return SimpleNamespace(**sealed.columns())


async def test_seal_open_round_trip_and_nothing_in_clear() -> None:
    custody = SchemaCustody(base64.b64encode(os.urandom(32)).decode(), "kek-test")
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
    custody = SchemaCustody(kek, "kek-test")
    cid = uuid.uuid4()
    sealed = await custody.seal(cid, generate_key_pair("x").private_openssh)
    with pytest.raises(InvalidTag):  # moved to another credential row
        await custody.open(uuid.uuid4(), _row(sealed))
    other = SchemaCustody(base64.b64encode(os.urandom(32)).decode(), "kek-test")
    with pytest.raises(InvalidTag):  # a different key-encryption key
        await other.open(cid, _row(sealed))
    tampered = _row(sealed)
    tampered.ciphertext = bytes([sealed.ciphertext[0] ^ 1]) + sealed.ciphertext[1:]
    with pytest.raises(InvalidTag):
        await custody.open(cid, tampered)
    with pytest.raises(ValueError):
        SchemaCustody(base64.b64encode(b"short").decode(), "k")
